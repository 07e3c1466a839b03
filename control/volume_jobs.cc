#include "control/volume_jobs.h"

#include <vector>

namespace shareblk::control {

VolumeJobs::~VolumeJobs() {
  stop_all();
}

bool VolumeJobs::start(const std::string& volume_id, Kind kind, Work work) {
  std::lock_guard lock(mutex_);
  reap();
  if (stopping_ || jobs_.count(volume_id) != 0) return false;
  Job& job = jobs_[volume_id];
  job.kind = kind;
  try {
    job.thread = std::thread([this, volume_id, work = std::move(work)] {
      const store::Progress progress = [this, &volume_id](uint64_t done, uint64_t total) {
        std::lock_guard inner(mutex_);
        Job& j = jobs_.at(volume_id);
        j.done = done;
        j.total = total;
        return !stopping_;
      };
      std::optional<ApiError> failure = work(progress);
      std::lock_guard inner(mutex_);
      Job& j = jobs_.at(volume_id);
      j.failure = std::move(failure);
      j.finished = true;
      changed_.notify_all();
    });
  } catch (...) {  // no thread (a pids limit): no job either
    jobs_.erase(volume_id);
    throw;
  }
  return true;
}

std::optional<VolumeJobs::State> VolumeJobs::state(const std::string& volume_id) const {
  std::lock_guard lock(mutex_);
  auto it = jobs_.find(volume_id);
  if (it == jobs_.end() || it->second.finished) return std::nullopt;
  const Job& j = it->second;
  const int percent = j.total == 0 ? 0 : static_cast<int>(j.done * 100 / j.total);
  return State{j.kind, percent};
}

std::optional<ApiError> VolumeJobs::wait(const std::string& volume_id) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    auto it = jobs_.find(volume_id);
    return it == jobs_.end() || it->second.finished;
  });
  auto it = jobs_.find(volume_id);
  return it == jobs_.end() ? std::nullopt : it->second.failure;
}

bool VolumeJobs::stopping() const {
  std::lock_guard lock(mutex_);
  return stopping_;
}

void VolumeJobs::stop_all() {
  // Joined outside the lock: a job's last steps take it.
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (auto& [id, job] : jobs_) threads.push_back(std::move(job.thread));
  }
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
  std::lock_guard lock(mutex_);
  jobs_.clear();
  changed_.notify_all();
}

size_t VolumeJobs::running() const {
  std::lock_guard lock(mutex_);
  size_t n = 0;
  for (const auto& [id, job] : jobs_) n += job.finished ? 0 : 1;
  return n;
}

void VolumeJobs::reap() {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (it->second.finished) {
      it->second.thread.join();  // it has finished its work: a moment at most
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace shareblk::control
