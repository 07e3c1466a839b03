#include "control/backing_jobs.h"

#include <spdlog/spdlog.h>

#include <system_error>

#include "control/api_error.h"
#include "control/service.h"
#include "control/shared_store.h"
#include "control/volume_jobs.h"
#include "control/volume_registry.h"

namespace shareblk::control {

std::optional<std::string> BackingJobs::roll_back_create(const std::string& id) {
  try {
    volumes_.remove(id);
    Database::Transaction tx(db_);
    tx.delete_volume(id);    // a fill's row, if any
    tx.delete_snapshot(id);  // or a snapshot's
    tx.delete_intent(id);
    tx.commit();
    return std::nullopt;
  } catch (const std::exception& e) {
    return e.what();
  }
}

void BackingJobs::start_populate(const std::string& id, const std::string& created_at,
                                 const std::string& what, Populate work) {
  try {
    jobs_.start(id, VolumeJobs::Kind::Fill,
                [this, id, created_at, what, work = std::move(work)](const store::Progress& p) {
                  return populate(id, created_at, what, work, p);
                });
  } catch (const std::exception& e) {  // no thread for it: status error, to delete
    spdlog::error("control: cannot start copying {} into {}: {}", what, id, e.what());
    Database::Transaction tx(db_);
    tx.put_intent({id, IntentAction::Create, std::string("cannot start: ") + e.what(), created_at});
    tx.commit();
  }
}

// A copy that fails keeps the intent with its error: the volume or snapshot shows status error,
// to be deleted. One that a stop interrupts is rolled back by the next start, like any create.
std::optional<ApiError> BackingJobs::populate(const std::string& id, const std::string& created_at,
                                              const std::string& what, const Populate& work,
                                              const store::Progress& progress) {
  const store::Progress paced = [&progress](uint64_t done, uint64_t total) {
    test_pause();
    return progress(done, total);
  };
  try {
    work(paced);
    crash_point("volume_create:filled");
    const VolumeLock lock = volumes_.lock(id);
    std::optional<VolumeRow> v;
    {
      Database::Transaction tx(db_);
      v = tx.volume(id);
    }
    if (v) shared_.publish(*v);  // before the intent goes: a crash between is finished at start
    Database::Transaction tx(db_);
    tx.delete_intent(id);
    tx.commit();
    spdlog::info("control: {} holds its copy of {}", id, what);
    return std::nullopt;
  } catch (const std::exception& e) {
    if (jobs_.stopping()) {
      spdlog::warn(
          "control: copying {} into {} stopped with the daemon; the next start rolls it "
          "back",
          what, id);
      return ApiError("internal", "the daemon stopped");
    }
    spdlog::error("control: cannot copy {} into {}: {}", what, id, e.what());
    try {
      Database::Transaction tx(db_);
      tx.put_intent({id, IntentAction::Create, e.what(), created_at});
      tx.commit();
    } catch (const std::exception& db) {
      spdlog::error("control: {}: cannot record why its copy failed: {}", id, db.what());
    }
    const auto* api = dynamic_cast<const ApiError*>(&e);
    return api != nullptr ? *api : ApiError("internal", e.what());
  }
}

void BackingJobs::start_delete(const std::string& id) {
  try {
    jobs_.start(id, VolumeJobs::Kind::Delete, [this, id](const store::Progress& progress) {
      return finish_delete(id, progress);
    });
  } catch (const std::system_error& e) {  // no thread for it: status error, to delete again
    spdlog::error("control: cannot start deleting volume {}: {}", id, e.what());
    Database::Transaction tx(db_);
    tx.put_intent({id, IntentAction::Delete, std::string("cannot start: ") + e.what(), now_iso()});
    tx.commit();
    throw ApiError("internal", std::string("cannot start the delete: ") + e.what());
  }
}

std::optional<ApiError> BackingJobs::finish_delete(const std::string& id,
                                                   const store::Progress& progress) {
  const store::Progress paced = [&progress](uint64_t done, uint64_t total) {
    if (done > 0 && done < total) crash_point("volume_delete:zeroing");
    test_pause();
    return progress(done, total);
  };
  try {
    volumes_.remove(id, paced);
  } catch (const ApiError& e) {
    if (jobs_.stopping()) {
      spdlog::warn(
          "control: deleting volume {} stopped with the daemon; the next start "
          "finishes it",
          id);
      return ApiError("internal", "the daemon stopped");
    }
    spdlog::error("control: cannot delete volume {}: {}", id, e.what());
    try {
      Database::Transaction tx(db_);
      tx.put_intent({id, IntentAction::Delete, e.what(), now_iso()});
      tx.commit();
    } catch (const std::exception& db) {  // the intent stays, without the store's words
      spdlog::error("control: volume {}: cannot record why its delete failed: {}", id, db.what());
    }
    return e;
  }
  crash_point("volume_delete:removed");
  try {
    const VolumeLock lock = volumes_.lock(id);
    Database::Transaction tx(db_);
    tx.delete_volume(id);
    tx.delete_snapshot(id);  // the id is a volume's or a snapshot's
    tx.delete_intent(id);
    tx.commit();
  } catch (const std::exception& e) {  // the intent stays: the next start finishes it
    spdlog::error("control: {}: backing removed, but the row stays: {}", id, e.what());
    return ApiError("internal", e.what());
  }
  spdlog::info("control: deleted {}", id);
  return std::nullopt;
}

BackingJobs::Populate BackingJobs::copy_job(const std::string& from, uint64_t length,
                                            const std::string& to, uint64_t size,
                                            std::shared_ptr<void> held) {
  return [this, from, length, to, size, held = std::move(held)](const store::Progress& p) mutable {
    struct Release {
      std::shared_ptr<void>& held;
      ~Release() { held.reset(); }
    } release{held};
    volumes_.copy(from, length, to, size, p);
  };
}

}  // namespace shareblk::control
