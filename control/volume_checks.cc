#include "control/volume_checks.h"

#include "control/api_error.h"
#include "control/volume_jobs.h"
#include "control/volume_registry.h"

namespace shareblk::control {

namespace {

std::string refused(const char* what, const std::string& id, const char* use) {
  return std::string(what) + " " + id + " cannot be " + use + ": ";
}

const char* job_of(const IntentRow& intent) {
  return intent.action == IntentAction::Delete ? "deleted" : "filled";
}

}  // namespace

VolumeRow find_volume(Database::Transaction& tx, const std::string& id) {
  auto v = tx.volume(id);
  if (!v) throw ApiError("not_found", "no volume " + id);
  return *v;
}

AttachmentRow find_attachment(Database::Transaction& tx, const std::string& id) {
  auto a = tx.attachment(id);
  if (!a) throw ApiError("not_found", "no attachment " + id);
  return *a;
}

std::string volume_of(Database& db, const std::string& attachment_id) {
  Database::Transaction tx(db);
  return find_attachment(tx, attachment_id).volume_id;
}

std::optional<std::string> VolumeChecks::error_of(const std::optional<IntentRow>& intent,
                                                  const std::string& id) const {
  if (intent && !intent->error.empty() && !jobs_.state(id)) {
    if (intent->action == IntentAction::Delete) {
      return "a volume_delete of it failed (" + intent->error + "); delete it again";
    }
    return "filling it failed (" + intent->error + "); delete it";
  }
  if (intent) return std::nullopt;  // being deleted or filled (from an image or a copy)
  return volumes_.missing(id);
}

void VolumeChecks::refuse_pending(Database::Transaction& tx, const char* what,
                                  const std::string& id, const char* use) const {
  const std::optional<IntentRow> intent = tx.intent(id);
  if (!intent) return;
  if (const std::optional<std::string> why = error_of(intent, id)) {
    throw ApiError("volume_error", refused(what, id, use) + *why);
  }
  throw ApiError("volume_busy", refused(what, id, use) + "it is being " + job_of(*intent));
}

void VolumeChecks::refuse_missing(const char* what, const std::string& id, uint64_t size,
                                  const char* use) const {
  if (const std::optional<std::string> why = volumes_.check(id, size)) {
    throw ApiError("volume_error", refused(what, id, use) + *why);
  }
}

void VolumeChecks::refuse_busy(Database::Transaction& tx, const VolumeRow& v,
                               const char* what) const {
  const std::optional<IntentRow> intent = tx.intent(v.id);
  if (!intent || error_of(intent, v.id)) return;
  throw ApiError("volume_busy", std::string("volume ") + v.id + " cannot " + what +
                                    " while it is being " + job_of(*intent));
}

}  // namespace shareblk::control
