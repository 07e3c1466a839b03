// Internal to control/: QoS limits (docs/qos.md). How a `qos` param is checked, how it is kept
// (JSON text in the qos columns) and shown, and the live limiters the NBD connections share.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "target/target.h"

namespace shareblk::control {

using Json = nlohmann::json;

// Cinder's front-end QoS spec: an object of `*_sec` and `*_sec_max` keys, each a non-negative
// integer (or a string of decimal digits, as Cinder keeps them); 0 is no limit. Refused with
// invalid_params naming the key: an unknown key, a bad value, a total_* with a read_* or
// write_* of the same unit, a *_max below its rate or without it. `{}` clears.
target::QosSpec decode_qos(const Json& qos);
// The keys that limit something (non-zero), as the API shows them; `{}` for none.
Json qos_json(const target::QosSpec& spec);
// As stored: "" when nothing is limited, else qos_json()'s text. Text that is not a spec
// (never written by us) reads as no limit.
std::string qos_text(const target::QosSpec& spec);
target::QosSpec qos_from_text(const std::string& text);

// The limiters of this run: one per volume, and one per attachment under its volume's. Made
// at first use from the stored specs, changed in place by the update calls, so that every
// connection that holds one sees a change at its next request.
class QosRegistry {
 public:
  // The attachment's limiter (made with these specs when it has none yet).
  std::shared_ptr<target::QosLimiter> attachment(const std::string& attachment_id,
                                                 const std::string& volume_id,
                                                 const std::string& attachment_qos,
                                                 const std::string& volume_qos);
  // Live changes, after the new spec is committed.
  void set_volume(const std::string& volume_id, const target::QosSpec& spec);
  void set_attachment(const std::string& attachment_id, const std::string& volume_id,
                      const target::QosSpec& spec, const std::string& volume_qos);
  // The attachment will not be served again in this run (detached, deleted).
  void forget_attachment(const std::string& attachment_id);

 private:
  std::shared_ptr<target::QosLimiter> volume_locked(const std::string& volume_id,
                                                    const std::string& volume_qos);
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<target::QosLimiter>> volumes_;
  std::map<std::string, std::shared_ptr<target::QosLimiter>> attachments_;
};

}  // namespace shareblk::control
