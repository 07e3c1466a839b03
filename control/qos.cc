#include "control/qos.h"

#include <cctype>

#include "control/api_error.h"

namespace shareblk::control {

using target::QosSpec;

namespace {

constexpr uint64_t kMaxValue = uint64_t{1} << 62;

// A non-negative integer, or a string of decimal digits.
uint64_t qos_value(const Json& v, const std::string& key) {
  const std::string what = "'qos." + key + "' must be a non-negative integer";
  if (v.is_number_unsigned()) {
    const auto n = v.get<uint64_t>();
    if (n > kMaxValue) invalid(what + " up to 2^62");
    return n;
  }
  if (v.is_number_integer()) invalid(what);  // negative
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s.empty() || s.size() > 19) invalid(what);
    uint64_t n = 0;
    for (char c : s) {
      if (std::isdigit(static_cast<unsigned char>(c)) == 0) invalid(what);
      n = n * 10 + static_cast<uint64_t>(c - '0');
    }
    if (n > kMaxValue) invalid(what + " up to 2^62");
    return n;
  }
  invalid(what);
}

}  // namespace

QosSpec decode_qos(const Json& qos) {
  if (!qos.is_object()) invalid("'qos' must be an object");
  QosSpec spec;
  for (const auto& [key, value] : qos.items()) {
    bool known = false;
    for (size_t k = 0; k < QosSpec::kKeys && !known; ++k) {
      const std::string rate = QosSpec::key_name(k);
      if (key == rate) {
        spec.rate[k] = qos_value(value, key);
        known = true;
      } else if (key == rate + "_max") {
        spec.burst[k] = qos_value(value, key);
        known = true;
      }
    }
    if (!known) invalid("unknown key 'qos." + key + "'");
  }
  // Cinder and QEMU refuse a total together with a read or write limit of the same unit.
  for (size_t unit : {size_t{QosSpec::TotalIops}, size_t{QosSpec::TotalBytes}}) {
    const auto set = [&](size_t k) { return spec.rate[k] != 0 || spec.burst[k] != 0; };
    if (!set(unit)) continue;
    for (size_t k : {unit + 1, unit + 2}) {
      if (set(k)) {
        invalid("'qos." + std::string(QosSpec::key_name(unit)) + "' cannot be combined with 'qos." +
                QosSpec::key_name(k) + "'");
      }
    }
  }
  for (size_t k = 0; k < QosSpec::kKeys; ++k) {
    if (spec.burst[k] == 0) continue;
    const std::string max = std::string("qos.") + QosSpec::key_name(k) + "_max";
    if (spec.rate[k] == 0) {
      invalid("'" + max + "' needs 'qos." + QosSpec::key_name(k) + "'");
    }
    if (spec.burst[k] < spec.rate[k]) {
      invalid("'" + max + "' must not be below 'qos." + QosSpec::key_name(k) + "'");
    }
  }
  return spec;
}

Json qos_json(const QosSpec& spec) {
  Json out = Json::object();
  for (size_t k = 0; k < QosSpec::kKeys; ++k) {
    if (spec.rate[k] != 0) out[QosSpec::key_name(k)] = spec.rate[k];
    if (spec.burst[k] != 0) out[std::string(QosSpec::key_name(k)) + "_max"] = spec.burst[k];
  }
  return out;
}

std::string qos_text(const QosSpec& spec) {
  return spec.limits() ? qos_json(spec).dump() : std::string();
}

QosSpec qos_from_text(const std::string& text) {
  if (text.empty()) return {};
  try {
    return decode_qos(Json::parse(text));
  } catch (const std::exception&) {  // not ours: nothing to enforce
    return {};
  }
}

std::shared_ptr<target::QosLimiter> QosRegistry::volume_locked(const std::string& volume_id,
                                                               const std::string& volume_qos) {
  auto& limiter = volumes_[volume_id];
  if (!limiter) limiter = target::QosLimiter::make(qos_from_text(volume_qos));
  return limiter;
}

std::shared_ptr<target::QosLimiter> QosRegistry::attachment(const std::string& attachment_id,
                                                            const std::string& volume_id,
                                                            const std::string& attachment_qos,
                                                            const std::string& volume_qos) {
  std::lock_guard lock(mutex_);
  auto& limiter = attachments_[attachment_id];
  if (!limiter) {
    limiter = target::QosLimiter::make(qos_from_text(attachment_qos),
                                       volume_locked(volume_id, volume_qos));
  }
  return limiter;
}

void QosRegistry::set_volume(const std::string& volume_id, const QosSpec& spec) {
  std::lock_guard lock(mutex_);
  auto& limiter = volumes_[volume_id];
  if (limiter) {
    limiter->set(spec);
  } else {
    limiter = target::QosLimiter::make(spec);
  }
}

void QosRegistry::set_attachment(const std::string& attachment_id, const std::string& volume_id,
                                 const QosSpec& spec, const std::string& volume_qos) {
  std::lock_guard lock(mutex_);
  auto& limiter = attachments_[attachment_id];
  if (limiter) {
    limiter->set(spec);
  } else {
    limiter = target::QosLimiter::make(spec, volume_locked(volume_id, volume_qos));
  }
}

void QosRegistry::forget_attachment(const std::string& attachment_id) {
  std::lock_guard lock(mutex_);
  attachments_.erase(attachment_id);
}

}  // namespace shareblk::control
