// A VolumeStore for the control-plane fuzzer: volumes are entries in a map, and every open()
// hands out the same small scratch volume, so that no input leaves a file behind and none
// costs more than a map lookup. Like tests/fake_volume_store.h (which needs the test support
// library), it fails the next call of a kind with the errno an input asks for. Thread-safe, as
// a store must be: deletes finish on the control plane's job threads.
#pragma once

#include <cerrno>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "fuzz/fuzz_volume.h"
#include "store/volume_store.h"

namespace shareblk::fuzz {

class FuzzStore final : public store::VolumeStore {
 public:
  enum class Call { Create, Extend, Remove, Open, Refresh, List };

  std::string kind() const override { return "fuzz"; }

  store::StoreError create(const std::string& id, uint64_t size) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Create)) return e;
    if (sizes_.count(id) != 0) return error(EEXIST, "volume exists");
    sizes_[id] = size;
    return {};
  }
  store::StoreError extend(const std::string& id, uint64_t size) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Extend)) return e;
    auto it = sizes_.find(id);
    if (it == sizes_.end()) return error(ENOENT, "no such volume");
    if (size < it->second) return error(EINVAL, "extend shrinks");  // the caller checks
    it->second = size;
    return {};
  }
  store::StoreError remove(const std::string& id, const store::Progress& /*progress*/) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Remove)) {
      // A real store says ENOENT only when the backing is not there, and the control plane
      // takes it for gone: an injected one is a backing that something else removed first.
      if (e.code.value() == ENOENT) sizes_.erase(id);
      return e;
    }
    if (sizes_.erase(id) == 0) return error(ENOENT, "no such volume");
    return {};
  }
  store::StoreError open(const std::string& id, uint64_t,
                         std::shared_ptr<backend::Volume>& out) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Open)) return e;
    if (sizes_.count(id) == 0) return error(ENOENT, "no such volume");
    if (!scratch_) scratch_ = scratch_volume(64 * 1024);
    out = scratch_;
    return {};
  }
  store::StoreError refresh(const std::string&, uint64_t, backend::Volume&) override {
    std::lock_guard lock(mutex_);
    return take(Call::Refresh);
  }
  store::StoreError list(std::vector<std::string>& ids) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::List)) return e;
    for (const auto& [id, size] : sizes_) ids.push_back(id);
    return {};
  }

  // The next call of kind `call` fails with `err`.
  void fail_next(Call call, int err) {
    std::lock_guard lock(mutex_);
    failures_[call] = err;
  }
  void clear_failures() {
    std::lock_guard lock(mutex_);
    failures_.clear();
  }
  size_t volume_count() const {
    std::lock_guard lock(mutex_);
    return sizes_.size();
  }

 private:
  static store::StoreError error(int err, const std::string& message) {
    return {std::error_code(err, std::generic_category()), "fuzz store: " + message};
  }
  store::StoreError take(Call call) {  // under mutex_
    auto it = failures_.find(call);
    if (it == failures_.end()) return {};
    const int err = it->second;
    failures_.erase(it);
    return error(err, "injected " + std::error_code(err, std::generic_category()).message());
  }

  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> sizes_;
  std::map<Call, int> failures_;
  std::shared_ptr<backend::Volume> scratch_;
};

}  // namespace shareblk::fuzz
