// Internal to control/: the long operations on one volume (a delete's zeroing, a fill from an
// image), each on a thread of its own, so that the call that starts one returns at once and
// other volumes' calls go on; and how far each has come, for the views.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "control/api_error.h"
#include "store/volume_store.h"

namespace shareblk::control {

class VolumeJobs {
 public:
  enum class Kind { Delete, Fill };
  struct State {
    Kind kind;
    int percent;  // 0 to 100
  };

  VolumeJobs() = default;
  ~VolumeJobs();  // stop_all()
  VolumeJobs(const VolumeJobs&) = delete;
  VolumeJobs& operator=(const VolumeJobs&) = delete;

  // What a job's work returns: why it failed, or nullopt.
  using Work = std::function<std::optional<ApiError>(const store::Progress&)>;

  // Runs `work` on a thread of its own, unless the volume has a job running (then false).
  // `work` reports through the store::Progress it is given, which returns false once the daemon
  // is stopping: the work then gives up, and the next start takes it up again.
  bool start(const std::string& volume_id, Kind kind, Work work);
  // The volume's running job.
  std::optional<State> state(const std::string& volume_id) const;
  // Waits until the volume has no running job; returns why the last one failed, if it did.
  std::optional<ApiError> wait(const std::string& volume_id);
  bool stopping() const;
  // Jobs whose work has not finished (the fuzzer waits for none before it cleans up).
  size_t running() const;
  // Tells every job to stop and waits for their threads.
  void stop_all();

 private:
  struct Job {
    Kind kind;
    uint64_t done = 0;
    uint64_t total = 0;
    bool finished = false;
    std::optional<ApiError> failure;
    std::thread thread;
  };
  void reap();  // joins the threads of finished jobs; under mutex_
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, Job> jobs_;
  bool stopping_ = false;
};

}  // namespace shareblk::control
