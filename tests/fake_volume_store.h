// A VolumeStore for unit tests of the control plane: it keeps its volumes in a map, records
// every call, and fails the next call of a kind with the error a test gives it. open() hands
// out a real backend::Volume on a small sparse file in the fake's own directory, so that
// attachments that are served still have bytes.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "store/volume_store.h"
#include "tests/support.h"

namespace shareblk::testing {

class FakeVolumeStore final : public store::VolumeStore {
 public:
  enum class Call { Create, Extend, Remove, Open, Refresh, List };

  std::string kind() const override { return "fake"; }

  store::StoreError create(const std::string& id, uint64_t size) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Create)) return e;
    if (sizes_.count(id) != 0) return error(EEXIST, "volume " + id + " exists");
    sizes_[id] = size;
    return {};
  }
  store::StoreError extend(const std::string& id, uint64_t size) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Extend)) return e;
    if (sizes_.count(id) == 0) return error(ENOENT, "no volume " + id);
    sizes_[id] = size;
    return {};
  }
  store::StoreError remove(const std::string& id, const store::Progress& /*progress*/) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Remove)) return e;
    if (sizes_.erase(id) == 0) return error(ENOENT, "no volume " + id);
    return {};
  }
  store::StoreError open(const std::string& id, uint64_t size,
                         std::shared_ptr<backend::Volume>& out) override {
    std::lock_guard lock(mutex_);
    if (auto e = take(Call::Open)) return e;
    if (sizes_.count(id) == 0) return error(ENOENT, "no volume " + id);
    const std::string path = dir_ / (id + ".img");
    make_file(path, size);
    std::error_code ec;
    out = backend::Volume::open(path, ec);
    if (ec) return {ec, ec.message()};
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
  // Volumes that have backing, with their sizes.
  std::map<std::string, uint64_t> volumes() const {
    std::lock_guard lock(mutex_);
    return sizes_;
  }
  // Calls of `call` so far.
  int calls(Call call) const {
    std::lock_guard lock(mutex_);
    auto it = counts_.find(call);
    return it == counts_.end() ? 0 : it->second;
  }

 private:
  static store::StoreError error(int err, const std::string& message) {
    return {std::error_code(err, std::generic_category()), message};
  }
  store::StoreError take(Call call) {
    ++counts_[call];
    auto it = failures_.find(call);
    if (it == failures_.end()) return {};
    const int err = it->second;
    failures_.erase(it);
    return error(err,
                 "fake store: injected " + std::error_code(err, std::generic_category()).message());
  }

  TempDir dir_;
  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> sizes_;
  std::map<Call, int> failures_;
  std::map<Call, int> counts_;
};

}  // namespace shareblk::testing
