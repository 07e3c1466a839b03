#include "control/service.h"

#include <arpa/inet.h>
#include <spdlog/spdlog.h>
#include <sys/random.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <set>

namespace shareblk::control {

namespace {

constexpr size_t kMaxName = 255;

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw ApiError("internal", "getrandom failed");
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

// A random (version 4) UUID.
std::string new_uuid() {
  std::string h = random_hex(16);
  h[12] = '4';
  h[16] = "89ab"[std::stoi(h.substr(16, 1), nullptr, 16) & 3];
  return h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" + h.substr(16, 4) +
         "-" + h.substr(20);
}

// UTC, ISO 8601, microseconds: sorts as it happened.
std::string now_iso() {
  auto now = std::chrono::system_clock::now();
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count();
  std::time_t secs = static_cast<std::time_t>(us / 1000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(us % 1000000));
  return buf;
}

[[noreturn]] void invalid(const std::string& message) {
  throw ApiError("invalid_params", message);
}

// Parameters are checked strictly: an unknown key is more likely a typo than an intent.
void only_keys(const Json& p, std::initializer_list<const char*> keys) {
  for (const auto& [key, value] : p.items()) {
    bool known = false;
    for (const char* k : keys) known = known || key == k;
    if (!known) invalid("unknown parameter '" + key + "'");
  }
}

std::string need_string(const Json& p, const char* key) {
  auto it = p.find(key);
  if (it == p.end()) invalid(std::string("missing parameter '") + key + "'");
  if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
    invalid(std::string("'") + key + "' must be a non-empty string");
  }
  return it->get<std::string>();
}

std::optional<std::string> opt_string(const Json& p, const char* key) {
  auto it = p.find(key);
  if (it == p.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) invalid(std::string("'") + key + "' must be a string");
  return it->get<std::string>();
}

std::optional<bool> opt_bool(const Json& p, const char* key) {
  auto it = p.find(key);
  if (it == p.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) invalid(std::string("'") + key + "' must be true or false");
  return it->get<bool>();
}

// Bytes, or a string with a K/M/G/T suffix (powers of 1024); a positive multiple of 512.
uint64_t parse_size(const Json& v) {
  uint64_t size = 0;
  if (v.is_number_unsigned()) {
    size = v.get<uint64_t>();
  } else if (v.is_number_integer() && v.get<int64_t>() > 0) {
    size = static_cast<uint64_t>(v.get<int64_t>());
  } else if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    size_t digits = 0;
    while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
    if (digits == 0 || digits > 19) invalid("size '" + s + "' is not a number of bytes");
    size = std::stoull(s.substr(0, digits));
    std::string suffix = s.substr(digits);
    if (suffix.size() == 2 && (suffix[1] == 'B' || suffix[1] == 'b' || suffix[1] == 'i')) {
      suffix.resize(1);  // "10GB", "10Gi" mean the same here
    }
    int shift = 0;
    if (suffix.empty()) {
      shift = 0;
    } else if (suffix.size() == 1 && std::string("KkMmGgTt").find(suffix[0]) != std::string::npos) {
      shift = 10 * (1 + static_cast<int>(std::string("KMGT").find(static_cast<char>(
                            std::toupper(static_cast<unsigned char>(suffix[0]))))));
    } else {
      invalid("size '" + s + "': unknown suffix (use K, M, G or T)");
    }
    if (shift > 0 && size > (UINT64_MAX >> shift)) invalid("size '" + s + "' is too large");
    size <<= shift;
  } else {
    invalid("size must be a number of bytes or a string such as \"10G\"");
  }
  if (size == 0 || size % 512 != 0) invalid("size must be a positive multiple of 512 bytes");
  if (size > (uint64_t{1} << 62)) invalid("size is too large");
  return size;
}

// Whether two textual IP addresses are one address: "::ffff:10.0.0.1" is 10.0.0.1 and
// "0:0::1" is ::1, as the peer's address is written one way only.
bool same_address(const std::string& a, const std::string& b) {
  auto parse = [](const std::string& text, in6_addr& out) {
    in_addr v4{};
    if (inet_pton(AF_INET, text.c_str(), &v4) == 1) {  // as the IPv4-mapped IPv6 address
      out = in6_addr{};
      out.s6_addr[10] = 0xff;
      out.s6_addr[11] = 0xff;
      std::memcpy(&out.s6_addr[12], &v4, sizeof v4);
      return true;
    }
    return inet_pton(AF_INET6, text.c_str(), &out) == 1;
  };
  in6_addr x{};
  in6_addr y{};
  return parse(a, x) && parse(b, y) && std::memcmp(&x, &y, sizeof x) == 0;
}

bool live(const AttachmentRow& a) {
  return a.attach_status != "detached";
}
bool serving(const AttachmentRow& a) {
  return a.attach_status == "attaching" || a.attach_status == "attached";
}

// One live attachment per instance and host: a second one is a caller's retry or mistake
// (Cinder's attachment API has the same rule). `host` is the one `a` has or is about to get.
void refuse_duplicate(const std::vector<AttachmentRow>& attachments, const AttachmentRow& a,
                      const std::string& host) {
  for (const auto& other : attachments) {
    if (other.id != a.id && live(other) && other.instance_uuid == a.instance_uuid &&
        other.attached_host == host) {
      throw ApiError("duplicate_attachment",
                     "instance " + a.instance_uuid + " already has attachment " + other.id);
    }
  }
}

std::string volume_status(const std::vector<AttachmentRow>& attachments) {
  // in-use > attaching > reserved > detaching > available (the aggregation order).
  for (const char* status : {"attached", "attaching", "reserved", "detaching"}) {
    for (const auto& a : attachments) {
      if (a.attach_status == status) {
        return std::string(status) == "attached" ? "in-use" : status;
      }
    }
  }
  return "available";
}

// A path as mountpoints are compared: absolute, with the symlinks of its existing part
// resolved, no "." or "..", no trailing "/".
std::filesystem::path comparable_path(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  if (ec) p = path.lexically_normal();
  if (!p.has_filename() && p.has_relative_path()) p = p.parent_path();
  return p;
}

// Whether one of two comparable paths is the other or inside it: a mount at either hides or
// is hidden by a mount at the other.
bool nested(const std::filesystem::path& a, const std::filesystem::path& b) {
  auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return ia == a.end() || ib == b.end();
}

ApiError store_error(const lvm::StoreError& e) {
  const int code = e.code.value();
  if (code == ENOSPC || code == EDQUOT || code == EFBIG) return ApiError("no_space", e.message);
  if (code == ENOENT) return ApiError("not_found", e.message);
  return ApiError("internal", e.message);
}

}  // namespace

Service::Service(const std::string& db_path, lvm::VolumeStore& store, Policy policy)
    : db_(db_path),
      store_(store),
      policy_(policy),
      state_dir_(comparable_path(std::filesystem::absolute(db_path).parent_path())) {
  reconcile();
}

void Service::bind(target::Server* server, Endpoints endpoints) {
  server_ = server;
  endpoints_ = std::move(endpoints);
  // FUSE attachments live as long as their attachment, across restarts: mount them again
  // (a stale mount of a killed daemon is cleared first).
  std::vector<std::pair<AttachmentRow, VolumeRow>> fuse_attachments;
  {
    Database::Transaction tx(db_);
    for (const AttachmentRow& a : tx.attachments()) {
      if (serving(a) && !a.connector.empty() &&
          Json::parse(a.connector).value("transport", "") == "fuse") {
        fuse_attachments.emplace_back(a, find_volume(tx, a.volume_id));
      }
    }
  }
  for (auto& [a, v] : fuse_attachments) {
    try {
      AttachmentRow copy = a;
      copy.attach_status = "reserved";  // connect() wants a state it may move from
      Database::Transaction tx(db_);    // connect() checks the mountpoint against the others
      connect(tx, copy, v, Json::parse(a.connector));
      spdlog::info("control: attachment {} mounted again at {}", a.id,
                   Json::parse(a.connector)["mountpoint"].get<std::string>());
    } catch (const std::exception& e) {
      spdlog::error("control: cannot mount attachment {} again: {}", a.id, e.what());
    }
  }
}

// At start-up: no connection survives a restart, so a detach that was under way is done; and
// the store and the database are compared, with differences reported, never "fixed" by
// deleting anything.
void Service::reconcile() {
  Database::Transaction tx(db_);
  for (AttachmentRow a : tx.attachments()) {
    if (a.attach_status == "detaching") {
      a.attach_status = "detached";
      a.detach_time = now_iso();
      tx.update_attachment(a);
      spdlog::info("control: attachment {} was detaching at shutdown; now detached", a.id);
    }
  }
  std::vector<std::string> ids;
  if (lvm::StoreError e = store_.list(ids)) {
    spdlog::error("control: cannot list the {} store: {}", store_.kind(), e.message);
  } else {
    std::set<std::string> backed(ids.begin(), ids.end());
    std::set<std::string> known;
    for (const VolumeRow& v : tx.volumes()) {
      known.insert(v.id);
      if (backed.count(v.id) == 0) {
        spdlog::error("control: volume {} ({}) has no backing in the {} store", v.id, v.name,
                      store_.kind());
      }
    }
    for (const std::string& id : ids) {
      if (known.count(id) == 0) {
        spdlog::warn("control: the {} store holds {} which no volume owns; left untouched",
                     store_.kind(), id);
      }
    }
  }
  tx.commit();
}

bool Service::has_method(const std::string& method) const {
  static const std::set<std::string> kMethods = {
      "volume_create",       "volume_list",       "volume_show",       "volume_delete",
      "volume_extend",       "volume_update",     "attachment_create", "attachment_update",
      "attachment_complete", "attachment_delete", "attachment_list",   "attachment_show",
      "volume_detach",       "export_resolve"};
  return kMethods.count(method) != 0;
}

Json Service::call(const std::string& method, const Json& p, const Caller& caller) {
  if (method == "volume_create") return volume_create(p);
  if (method == "volume_list") return volume_list(p);
  if (method == "volume_show") return volume_show(p);
  if (method == "volume_delete") return volume_delete(p);
  if (method == "volume_extend") return volume_extend(p);
  if (method == "volume_update") return volume_update(p);
  if (method == "attachment_create") return attachment_create(p);
  if (method == "attachment_update") return attachment_update(p);
  if (method == "attachment_complete") return attachment_complete(p);
  if (method == "attachment_delete") return attachment_delete(p);
  if (method == "attachment_list") return attachment_list(p);
  if (method == "attachment_show") return attachment_show(p);
  if (method == "volume_detach") return volume_detach(p);
  if (method == "export_resolve") return export_resolve(p, caller);
  throw ApiError("not_found", "unknown method '" + method + "'");
}

// The table holds an entry only while someone holds or waits for that volume's lock: ids come
// from clients, unknown ones included, and an entry per id ever seen grew without bound. Every
// holder and waiter shares one mutex, so changes to one volume are still serialized.
std::shared_ptr<std::mutex> Service::volume_lock(const std::string& volume_id) {
  std::lock_guard lock(locks_mutex_);
  std::weak_ptr<std::mutex>& entry = volume_locks_[volume_id];
  if (auto m = entry.lock()) return m;
  auto m = std::shared_ptr<std::mutex>(new std::mutex, [this, volume_id](std::mutex* last) {
    {
      std::lock_guard table(locks_mutex_);
      auto it = volume_locks_.find(volume_id);
      if (it != volume_locks_.end() && it->second.expired()) volume_locks_.erase(it);
    }
    delete last;
  });
  entry = m;
  return m;
}

size_t Service::volume_lock_count() const {
  std::lock_guard lock(locks_mutex_);
  return volume_locks_.size();
}

void Service::set_max_subscribers(size_t n) {
  std::lock_guard lock(subscribers_mutex_);
  max_subscribers_ = n;
}

size_t Service::subscriber_count() const {
  std::lock_guard lock(subscribers_mutex_);
  return subscribers_.size();
}

std::shared_ptr<backend::Volume> Service::open_volume(const std::string& volume_id, uint64_t size) {
  std::lock_guard lock(open_mutex_);
  auto& v = open_volumes_[volume_id];
  if (!v) {
    if (lvm::StoreError e = store_.open(volume_id, size, v)) {
      open_volumes_.erase(volume_id);
      spdlog::error("control: cannot open volume {}: {}", volume_id, e.message);
      return nullptr;
    }
  }
  return v;
}

void Service::forget_volume(const std::string& volume_id) {
  std::lock_guard lock(open_mutex_);
  open_volumes_.erase(volume_id);
}

// The volume an attachment belongs to, looked up before taking that volume's lock.
std::string Service::volume_of(const std::string& attachment_id) {
  Database::Transaction tx(db_);
  return find_attachment(tx, attachment_id).volume_id;
}

VolumeRow Service::find_volume(Database::Transaction& tx, const std::string& id) {
  auto v = tx.volume(id);
  if (!v) throw ApiError("not_found", "no volume " + id);
  return *v;
}

AttachmentRow Service::find_attachment(Database::Transaction& tx, const std::string& id) {
  auto a = tx.attachment(id);
  if (!a) throw ApiError("not_found", "no attachment " + id);
  return *a;
}

// --- JSON views ---

Json Service::connection_info(const AttachmentRow& a, const VolumeRow& v) {
  if (!serving(a) || a.connector.empty()) return nullptr;
  const Json connector = Json::parse(a.connector);
  const std::string transport = connector.value("transport", "tcp");
  if (transport == "fuse") {
    return Json{{"driver_volume_type", "local"},
                {"data",
                 {{"device_path", connector["mountpoint"].get<std::string>() + "/disk"},
                  {"access_mode", a.mode},
                  {"shareable", v.multiattach},
                  {"size", v.size}}}};
  }
  std::string uri;
  if (transport == "unix") {
    uri = "nbd+unix:///" + a.export_name + "?socket=" + endpoints_.unix_socket;
  } else {
    uri = "nbd://" + endpoints_.tcp + "/" + a.export_name;
  }
  return Json{{"driver_volume_type", "nbd"},
              {"data",
               {{"export_name", a.export_name},
                {"uri", uri},
                {"access_mode", a.mode},
                {"shareable", v.multiattach},
                {"size", v.size}}}};
}

Json Service::attachment_json(const AttachmentRow& a, const VolumeRow& v) {
  auto or_null = [](const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); };
  return Json{{"id", a.id},
              {"volume_id", a.volume_id},
              {"instance_uuid", a.instance_uuid},
              {"attached_host", or_null(a.attached_host)},
              {"mode", a.mode},
              {"attach_status", a.attach_status},
              {"attach_time", or_null(a.attach_time)},
              {"detach_time", or_null(a.detach_time)},
              {"connector", a.connector.empty() ? Json(nullptr) : Json::parse(a.connector)},
              {"connection_info", connection_info(a, v)},
              {"connections", server_ ? server_->connections(a.id) : 0}};
}

Json Service::volume_json(Database::Transaction& tx, const VolumeRow& v) {
  std::vector<AttachmentRow> all = tx.attachments(v.id);
  Json attachments = Json::array();
  for (const auto& a : all) {
    if (live(a)) attachments.push_back(attachment_json(a, v));
  }
  return Json{{"id", v.id},
              {"name", v.name},
              {"size", v.size},
              {"multiattach", v.multiattach},
              {"bootable", v.bootable},
              {"status", volume_status(all)},
              {"created_at", v.created_at},
              {"attachments", attachments}};
}

// --- Volumes ---

Json Service::volume_create(const Json& p) {
  only_keys(p, {"name", "size", "multiattach", "bootable"});
  VolumeRow v;
  v.name = need_string(p, "name");
  if (v.name.size() > kMaxName) invalid("name is longer than 255 bytes");
  if (!p.contains("size")) invalid("missing parameter 'size'");
  v.size = parse_size(p["size"]);
  v.multiattach = opt_bool(p, "multiattach").value_or(false);
  v.bootable = opt_bool(p, "bootable").value_or(false);
  if (v.multiattach && !policy_.allow_multiattach) {
    throw ApiError("policy_denied", "policy forbids multiattach volumes");
  }
  v.id = new_uuid();
  v.created_at = now_iso();
  if (lvm::StoreError e = store_.create(v.id, v.size)) throw store_error(e);
  try {
    Database::Transaction tx(db_);
    tx.insert_volume(v);
    Json out = volume_json(tx, v);
    tx.commit();
    spdlog::info("control: created volume {} ({}, {} bytes)", v.id, v.name, v.size);
    return out;
  } catch (...) {
    store_.remove(v.id);  // never leave backing that no volume owns
    throw;
  }
}

Json Service::volume_list(const Json& p) {
  only_keys(p, {});
  Database::Transaction tx(db_);
  Json out = Json::array();
  for (const VolumeRow& v : tx.volumes()) out.push_back(volume_json(tx, v));
  return out;
}

Json Service::volume_show(const Json& p) {
  only_keys(p, {"volume_id"});
  Database::Transaction tx(db_);
  return volume_json(tx, find_volume(tx, need_string(p, "volume_id")));
}

Json Service::volume_delete(const Json& p) {
  only_keys(p, {"volume_id"});
  const std::string id = need_string(p, "volume_id");
  auto lock_holder = volume_lock(id);
  std::lock_guard lock(*lock_holder);
  {
    Database::Transaction tx(db_);
    VolumeRow v = find_volume(tx, id);
    for (const auto& a : tx.attachments(id)) {
      if (live(a)) {
        throw ApiError("volume_in_use",
                       "volume " + id + " has attachment " + a.id + " (" + a.attach_status + ")");
      }
    }
  }
  // Backing first: if the store fails, the volume is still there to retry on.
  forget_volume(id);
  if (lvm::StoreError e = store_.remove(id)) throw store_error(e);
  Database::Transaction tx(db_);
  tx.delete_volume(id);
  tx.commit();
  spdlog::info("control: deleted volume {}", id);
  return Json{{"id", id}, {"deleted", true}};
}

Json Service::volume_extend(const Json& p) {
  only_keys(p, {"volume_id", "size"});
  const std::string id = need_string(p, "volume_id");
  if (!p.contains("size")) invalid("missing parameter 'size'");
  const uint64_t size = parse_size(p["size"]);
  auto lock_holder = volume_lock(id);
  std::lock_guard lock(*lock_holder);
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    v = find_volume(tx, id);
  }
  if (size <= v.size) {
    invalid("a volume only grows: " + std::to_string(size) + " <= " + std::to_string(v.size));
  }
  if (lvm::StoreError e = store_.extend(id, size)) throw store_error(e);
  Database::Transaction tx(db_);
  v.size = size;
  tx.update_volume(v);
  Json out = volume_json(tx, v);
  tx.commit();
  {
    std::lock_guard open_lock(open_mutex_);
    auto it = open_volumes_.find(id);
    if (it != open_volumes_.end()) {
      if (lvm::StoreError e = store_.refresh(id, size, *it->second)) {
        // New connections reopen it; live ones keep the old size.
        spdlog::error("control: volume {} grew but its open handle did not: {}", id, e.message);
        open_volumes_.erase(it);
      }
    }
  }
  return out;
}

Json Service::volume_update(const Json& p) {
  only_keys(p, {"volume_id", "multiattach", "bootable", "name"});
  const std::string id = need_string(p, "volume_id");
  auto lock_holder = volume_lock(id);
  std::lock_guard lock(*lock_holder);
  Database::Transaction tx(db_);
  VolumeRow v = find_volume(tx, id);
  if (auto name = opt_string(p, "name")) {
    if (name->empty() || name->size() > kMaxName) invalid("name must be 1 to 255 bytes");
    v.name = *name;
  }
  if (auto multiattach = opt_bool(p, "multiattach"); multiattach && *multiattach != v.multiattach) {
    // Hypervisors decide caching and locking at attach time, so only an unattached volume
    // may change (Cinder's retype rule).
    if (volume_status(tx.attachments(id)) != "available") {
      throw ApiError("volume_in_use", "multiattach can change only while the volume is available");
    }
    if (*multiattach && !policy_.allow_multiattach) {
      throw ApiError("policy_denied", "policy forbids multiattach volumes");
    }
    v.multiattach = *multiattach;
  }
  if (auto bootable = opt_bool(p, "bootable")) {
    // Making a volume that several attachments share bootable would make the shared bootable
    // volume that the policy forbids attaching.
    if (*bootable && !v.bootable && !policy_.allow_multiattach_bootable) {
      size_t live_attachments = 0;
      for (const auto& a : tx.attachments(id)) live_attachments += live(a) ? 1 : 0;
      if (live_attachments > 1) {
        throw ApiError("policy_denied",
                       "policy forbids a bootable volume with several attachments");
      }
    }
    v.bootable = *bootable;
  }
  tx.update_volume(v);
  Json out = volume_json(tx, v);
  tx.commit();
  return out;
}

// --- Attachments ---

// A FUSE mount over another attachment's would be cleared by LocalAttach::mount (it takes it
// for a stale one), and the other's detach would unmount this one; a mount in or over the
// state directory would hide the database or the volumes. Refused as invalid_params, as a failed
// mount is: the caller must name another mountpoint, while invalid_state is about the
// attachment's own state. The caller's transaction holds the database (and so every
// attachment_create and attachment_update) until the mount is recorded: no race between two.
void Service::refuse_taken_mountpoint(Database::Transaction& tx, const AttachmentRow& a,
                                      const std::string& mountpoint) {
  const std::filesystem::path wanted = comparable_path(mountpoint);
  if (nested(wanted, state_dir_)) {
    invalid("mountpoint " + mountpoint + " overlaps the state directory " + state_dir_.string());
  }
  for (const AttachmentRow& other : tx.attachments()) {
    if (other.id == a.id || !live(other) || other.connector.empty()) continue;
    const Json c = Json::parse(other.connector);
    if (c.value("transport", "") != "fuse" || !c.contains("mountpoint")) continue;
    const std::string theirs = c["mountpoint"].get<std::string>();
    if (nested(wanted, comparable_path(theirs))) {
      std::string why = "mountpoint " + mountpoint;
      why += " overlaps " + theirs;
      why += " of attachment " + other.id;
      invalid(why);
    }
  }
}

void Service::connect(Database::Transaction& tx, AttachmentRow& a, const VolumeRow& v,
                      const Json& connector) {
  if (!connector.is_object()) invalid("connector must be an object");
  only_keys(connector, {"host", "ip", "transport", "initiator", "platform", "os_type", "multipath",
                        "mountpoint"});
  need_string(connector, "host");
  const std::string transport = opt_string(connector, "transport").value_or("tcp");
  if (transport == "tcp") {
    if (endpoints_.tcp.empty()) invalid("this daemon has no TCP listener");
  } else if (transport == "unix") {
    if (endpoints_.unix_socket.empty()) invalid("this daemon has no Unix socket listener");
  } else if (transport == "fuse") {
    const std::string mountpoint = need_string(connector, "mountpoint");
    if (mountpoint.front() != '/') invalid("mountpoint must be an absolute path");
    refuse_taken_mountpoint(tx, a, mountpoint);
  } else {
    invalid("connector transport must be \"tcp\", \"unix\" or \"fuse\"");
  }
  if (auto ip = opt_string(connector, "ip")) {
    unsigned char buf[16];
    if (inet_pton(AF_INET, ip->c_str(), buf) != 1 && inet_pton(AF_INET6, ip->c_str(), buf) != 1) {
      invalid("connector ip '" + *ip + "' is not an IP address");
    }
  }
  if (a.attach_status != "reserved" && a.attach_status != "attaching") {
    throw ApiError("invalid_state", "attachment " + a.id + " is " + a.attach_status);
  }
  // A new connector replaces the old one, and with it any mount the old one had.
  bool lazy = false;
  unmount(a.id, lazy);
  if (transport == "fuse") {
    auto volume = open_volume(a.volume_id, v.size);
    if (!volume) throw ApiError("internal", "cannot open volume " + a.volume_id);
    std::string error;
    auto mount = fuse::LocalAttach::mount(
        connector["mountpoint"].get<std::string>(),
        backend::Handle(volume, a.mode == "ro" ? backend::AttachMode::ReadOnly
                                               : backend::AttachMode::ReadWrite),
        error);
    if (!mount) throw ApiError("invalid_params", error);
    std::lock_guard lock(mounts_mutex_);
    mounts_[a.id] = std::move(mount);
  }
  // A null value means absent (opt_string above): stored, it would read as a value later.
  Json stored = Json::object();
  for (const auto& [key, value] : connector.items()) {
    if (!value.is_null()) stored[key] = value;
  }
  stored["transport"] = transport;
  a.connector = stored.dump();
  a.attach_status = "attaching";
  if (a.attached_host.empty()) a.attached_host = connector["host"].get<std::string>();
}

void Service::unmount(const std::string& attachment_id, bool& lazy) {
  std::unique_ptr<fuse::LocalAttach> mount;
  {
    std::lock_guard lock(mounts_mutex_);
    auto it = mounts_.find(attachment_id);
    if (it == mounts_.end()) return;
    mount = std::move(it->second);
    mounts_.erase(it);
  }
  lazy = mount->unmount();
  if (lazy) {
    spdlog::warn("control: {} was busy; detached lazily (no I/O goes through it any more)",
                 mount->mountpoint());
  }
}

void Service::notify_revoked(const std::string& attachment_id) {
  std::vector<std::shared_ptr<Subscriber>> targets;
  {
    std::lock_guard lock(subscribers_mutex_);
    auto [first, last] = subscribers_.equal_range(attachment_id);
    for (auto it = first; it != last; ++it) {
      if (auto s = it->second.lock()) targets.push_back(std::move(s));
    }
    subscribers_.erase(first, last);
  }
  const std::string line = Json{{"jsonrpc", "2.0"},
                                {"method", "attachment_revoked"},
                                {"params", {{"attachment_id", attachment_id}}}}
                               .dump();
  for (const auto& s : targets) s->notify(line);
}

Json Service::attachment_create(const Json& p) {
  only_keys(p, {"volume_id", "instance_uuid", "attached_host", "mode", "connector"});
  const std::string volume_id = need_string(p, "volume_id");
  AttachmentRow a;
  a.volume_id = volume_id;
  a.instance_uuid = need_string(p, "instance_uuid");
  a.attached_host = opt_string(p, "attached_host").value_or("");
  // connect() names the host after the connector when none is given; the duplicate check
  // below must compare that same host, or one instance could attach twice through one host.
  if (a.attached_host.empty() && p.contains("connector") && p["connector"].is_object()) {
    a.attached_host = opt_string(p["connector"], "host").value_or("");
  }
  a.mode = opt_string(p, "mode").value_or("rw");
  if (a.mode != "rw" && a.mode != "ro") invalid("mode must be \"rw\" or \"ro\"");

  auto lock_holder = volume_lock(volume_id);
  std::lock_guard lock(*lock_holder);
  Database::Transaction tx(db_);
  VolumeRow v = find_volume(tx, volume_id);
  std::vector<AttachmentRow> current;
  for (auto& other : tx.attachments(volume_id)) {
    if (live(other)) current.push_back(std::move(other));
  }
  refuse_duplicate(current, a, a.attached_host);
  if (!current.empty()) {
    if (!v.multiattach) {
      throw ApiError("not_multiattach", "volume " + volume_id + " is attached (" +
                                            current.front().id + ") and is not multiattach");
    }
    if (!policy_.allow_multiattach) {
      throw ApiError("policy_denied", "policy forbids multiattach");
    }
    if (v.bootable && !policy_.allow_multiattach_bootable) {
      throw ApiError("policy_denied", "policy forbids attaching a bootable volume twice");
    }
  }
  a.id = new_uuid();
  a.export_name = random_hex(16);  // 128 random bits: the name is the capability
  a.attach_status = "reserved";
  a.created_at = now_iso();
  if (p.contains("connector") && !p["connector"].is_null()) connect(tx, a, v, p["connector"]);
  try {
    tx.insert_attachment(a);
    tx.commit();
  } catch (...) {
    bool lazy = false;
    unmount(a.id, lazy);  // never a mount the database does not know of
    throw;
  }
  Json out = attachment_json(a, v);
  spdlog::info("control: attachment {} of volume {} for {} ({}, {})", a.id, volume_id,
               a.instance_uuid, a.mode, a.attach_status);
  return out;
}

Json Service::attachment_update(const Json& p) {
  only_keys(p, {"attachment_id", "connector"});
  const std::string id = need_string(p, "attachment_id");
  if (!p.contains("connector")) invalid("missing parameter 'connector'");
  const std::string volume_id = volume_of(id);
  auto lock_holder = volume_lock(volume_id);
  std::lock_guard lock(*lock_holder);
  Database::Transaction tx(db_);
  AttachmentRow a = find_attachment(tx, id);
  VolumeRow v = find_volume(tx, volume_id);
  // A reservation without a host takes the connector's (see connect()): that host must not
  // make it a duplicate, which attachment_create could not see yet.
  const Json& connector = p["connector"];
  const bool connectable = a.attach_status == "reserved" || a.attach_status == "attaching";
  if (connectable && a.attached_host.empty() && connector.is_object() &&
      connector.contains("host") && connector["host"].is_string()) {
    refuse_duplicate(tx.attachments(volume_id), a, connector["host"].get<std::string>());
  }
  connect(tx, a, v, connector);
  try {
    tx.update_attachment(a);
    tx.commit();
  } catch (...) {
    bool lazy = false;
    unmount(a.id, lazy);
    throw;
  }
  return attachment_json(a, v);
}

Json Service::attachment_complete(const Json& p) {
  only_keys(p, {"attachment_id"});
  const std::string id = need_string(p, "attachment_id");
  const std::string volume_id = volume_of(id);
  auto lock_holder = volume_lock(volume_id);
  std::lock_guard lock(*lock_holder);
  Database::Transaction tx(db_);
  AttachmentRow a = find_attachment(tx, id);
  VolumeRow v = find_volume(tx, volume_id);
  if (a.attach_status == "attaching") {
    a.attach_status = "attached";
    a.attach_time = now_iso();
    tx.update_attachment(a);
  } else if (a.attach_status != "attached") {
    throw ApiError("invalid_state", "attachment " + id + " is " + a.attach_status +
                                        "; it needs a connector first (attachment_update)");
  }
  Json out = attachment_json(a, v);
  tx.commit();
  return out;
}

// Marks the attachment detaching (its export name is refused from then on), closes its NBD
// connections once their requests in flight are answered, then marks it detached.
// The caller holds the volume lock.
Json Service::detach(const std::string& volume_id, const std::string& attachment_id) {
  VolumeRow v;
  AttachmentRow a;
  {
    Database::Transaction tx(db_);
    a = find_attachment(tx, attachment_id);
    v = find_volume(tx, volume_id);
    if (a.attach_status == "detached") return attachment_json(a, v);
    a.attach_status = "detaching";
    tx.update_attachment(a);
    tx.commit();
  }
  // Processes that serve the attachment themselves (nbdkit) are told first; they refuse it
  // from their next request on, and the detach does not wait for them.
  notify_revoked(a.id);
  if (server_ != nullptr) server_->close_group(a.id);
  bool lazy = false;
  unmount(a.id, lazy);
  Database::Transaction tx(db_);
  a.attach_status = "detached";
  a.detach_time = now_iso();
  tx.update_attachment(a);
  Json out = attachment_json(a, v);
  tx.commit();
  if (lazy) out["unmounted_lazily"] = true;
  spdlog::info("control: attachment {} of volume {} detached", a.id, volume_id);
  return out;
}

Json Service::attachment_delete(const Json& p) {
  only_keys(p, {"attachment_id"});
  const std::string id = need_string(p, "attachment_id");
  const std::string volume_id = volume_of(id);
  auto lock_holder = volume_lock(volume_id);
  std::lock_guard lock(*lock_holder);
  return detach(volume_id, id);
}

Json Service::volume_detach(const Json& p) {
  only_keys(p, {"volume_id", "attachment_id"});
  const std::string volume_id = need_string(p, "volume_id");
  auto attachment_id = opt_string(p, "attachment_id");
  auto lock_holder = volume_lock(volume_id);
  std::lock_guard lock(*lock_holder);
  {
    Database::Transaction tx(db_);
    find_volume(tx, volume_id);
    std::vector<AttachmentRow> current;
    for (auto& a : tx.attachments(volume_id)) {
      if (live(a)) current.push_back(std::move(a));
    }
    if (attachment_id) {
      AttachmentRow a = find_attachment(tx, *attachment_id);
      if (a.volume_id != volume_id) {
        throw ApiError("not_found",
                       "attachment " + *attachment_id + " is not of volume " + volume_id);
      }
    } else if (current.empty()) {
      throw ApiError("invalid_state", "volume " + volume_id + " is not attached");
    } else if (current.size() > 1) {
      throw ApiError("attachment_id_required", "volume " + volume_id + " has " +
                                                   std::to_string(current.size()) +
                                                   " attachments; say which to detach");
    } else {
      attachment_id = current.front().id;
    }
  }
  return detach(volume_id, *attachment_id);
}

Json Service::attachment_list(const Json& p) {
  only_keys(p, {"volume_id"});
  const std::string volume_id = opt_string(p, "volume_id").value_or("");
  Database::Transaction tx(db_);
  if (!volume_id.empty()) find_volume(tx, volume_id);
  Json out = Json::array();
  std::map<std::string, VolumeRow> volumes;
  for (const AttachmentRow& a : tx.attachments(volume_id)) {
    auto it = volumes.find(a.volume_id);
    if (it == volumes.end()) it = volumes.emplace(a.volume_id, find_volume(tx, a.volume_id)).first;
    out.push_back(attachment_json(a, it->second));
  }
  return out;
}

Json Service::attachment_show(const Json& p) {
  only_keys(p, {"attachment_id"});
  Database::Transaction tx(db_);
  AttachmentRow a = find_attachment(tx, need_string(p, "attachment_id"));
  return attachment_json(a, find_volume(tx, a.volume_id));
}

// Tells another process (the nbdkit plugin) where a live attachment's bytes are and in which
// mode, and subscribes the caller to its revocation.
Json Service::export_resolve(const Json& p, const Caller& caller) {
  only_keys(p, {"export_name"});
  const std::string name = need_string(p, "export_name");
  AttachmentRow a;
  VolumeRow v;
  {
    Database::Transaction tx(db_);
    auto found = tx.attachment_by_export(name);
    if (!found || !serving(*found)) throw ApiError("not_found", "no live export of that name");
    a = *found;
    v = find_volume(tx, a.volume_id);
  }
  auto volume = open_volume(a.volume_id, v.size);
  if (!volume) throw ApiError("internal", "cannot open volume " + a.volume_id);
  Json segments = Json::array();
  for (const backend::MappedSegment& m : volume->layout()) {
    segments.push_back({{"path", m.path}, {"offset", m.offset}, {"length", m.length}});
  }
  if (!caller.subscriber.expired()) {
    {
      // Every nbdkit connection resolves and then goes away: drop the subscribers that are
      // gone, and register a client once per attachment, or the table grows with each call.
      std::lock_guard lock(subscribers_mutex_);
      std::erase_if(subscribers_, [](const auto& entry) { return entry.second.expired(); });
      auto [first, last] = subscribers_.equal_range(a.id);
      const bool known = std::any_of(first, last, [&](const auto& entry) {
        return !entry.second.owner_before(caller.subscriber) &&
               !caller.subscriber.owner_before(entry.second);
      });
      if (!known && subscribers_.size() >= max_subscribers_) {
        throw ApiError("internal", "too many subscribed connections (" +
                                       std::to_string(max_subscribers_) +
                                       "); the rest of the control connections are kept for "
                                       "operators");
      }
      if (!known) subscribers_.emplace(a.id, caller.subscriber);
    }
    // A detach that began before we subscribed has already sent its notices: look again.
    Database::Transaction tx(db_);
    auto now = tx.attachment(a.id);
    if (!now || !serving(*now)) throw ApiError("not_found", "no live export of that name");
  }
  return Json{{"attachment_id", a.id},
              {"volume_id", a.volume_id},
              {"mode", a.mode},
              {"size", v.size},
              {"backing", {{"mapped", volume->is_mapped()}, {"segments", segments}}}};
}

// --- The catalog ---

target::ExportCatalog::Lookup Service::resolve(const std::string& export_name,
                                               const target::Peer& peer) {
  using Refusal = target::ExportCatalog::Refusal;
  AttachmentRow a;
  uint64_t size = 0;
  {
    Database::Transaction tx(db_);
    auto found = tx.attachment_by_export(export_name);
    if (!found || !serving(*found)) return {std::nullopt, Refusal::Unknown};
    a = *found;
    size = find_volume(tx, a.volume_id).size;
  }
  const Json connector = Json::parse(a.connector);
  // A null ip, which older daemons stored, is no ip.
  if (!peer.address.empty() && connector.contains("ip") && connector["ip"].is_string() &&
      !same_address(connector["ip"].get<std::string>(), peer.address)) {
    spdlog::warn("control: attachment {} refused a client from {} (connector ip {})", a.id,
                 peer.address, connector["ip"].get<std::string>());
    return {std::nullopt, Refusal::Policy};
  }
  auto volume = open_volume(a.volume_id, size);
  if (!volume) return {std::nullopt, Refusal::Unknown};
  return {target::Export{
      volume, a.mode == "ro" ? backend::AttachMode::ReadOnly : backend::AttachMode::ReadWrite, a.id,
      ""}};
}

}  // namespace shareblk::control
