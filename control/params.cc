#include "control/params.h"

#include <arpa/inet.h>

#include <cctype>

#include "control/api_error.h"

namespace shareblk::control {

void only_keys(const Json& p, std::span<const std::string_view> keys) {
  for (const auto& [key, value] : p.items()) {
    bool known = false;
    for (std::string_view k : keys) known = known || key == k;
    if (!known) invalid("unknown parameter '" + key + "'");
  }
}

namespace {

const std::string& checked_text(const Json& value, const char* key, size_t max_bytes) {
  const auto& text = value.get_ref<const std::string&>();
  if (text.size() > max_bytes) {
    invalid(std::string("'") + key + "' is longer than " + std::to_string(max_bytes) + " bytes");
  }
  if (text.find('\0') != std::string::npos) {
    invalid(std::string("'") + key + "' must not contain a NUL character");
  }
  return text;
}

}  // namespace

std::string need_string(const Json& p, const char* key, size_t max_bytes) {
  auto it = p.find(key);
  if (it == p.end()) invalid(std::string("missing parameter '") + key + "'");
  if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
    invalid(std::string("'") + key + "' must be a non-empty string");
  }
  return checked_text(*it, key, max_bytes);
}

std::optional<std::string> opt_string(const Json& p, const char* key, size_t max_bytes) {
  auto it = p.find(key);
  if (it == p.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) invalid(std::string("'") + key + "' must be a string");
  return checked_text(*it, key, max_bytes);
}

std::optional<bool> opt_bool(const Json& p, const char* key) {
  auto it = p.find(key);
  if (it == p.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) invalid(std::string("'") + key + "' must be true or false");
  return it->get<bool>();
}

backend::AttachMode opt_mode(const Json& p, const char* key) {
  const std::optional<std::string> text = opt_string(p, key);
  if (!text) return backend::AttachMode::ReadWrite;
  if (const auto mode = backend::parse_attach_mode(*text)) return *mode;
  invalid(std::string(key) + " must be \"rw\" or \"ro\"");
}

std::optional<WriterPolicy> opt_writer_policy(const Json& p, const char* key) {
  const std::optional<std::string> policy = opt_string(p, key);
  if (!policy) return std::nullopt;
  if (auto named = writer_policy_named(*policy)) return named;
  invalid(std::string(key) + " must be \"multi\" or \"single\"");
}

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

uint64_t need_size(const Json& p, const char* key) {
  if (!p.contains(key)) invalid(std::string("missing parameter '") + key + "'");
  return parse_size(p[key]);
}

Connector decode_connector(const Json& connector) {
  if (!connector.is_object()) invalid("connector must be an object");
  static constexpr std::string_view kConnectorKeys[] = {
      "host",      "ip",         "transport", "initiator", "platform", "os_type",
      "multipath", "mountpoint", "uid",       "tls",       "tls_dn",   "multi_conn"};
  only_keys(connector, kConnectorKeys);
  Connector c;
  c.host = need_string(connector, "host");
  c.transport = opt_string(connector, "transport").value_or("tcp");
  if (c.transport == "fuse") {
    c.mountpoint = need_string(connector, "mountpoint", kMaxPath);
    if (c.mountpoint.front() != '/') invalid("mountpoint must be an absolute path");
  } else if (c.transport != "tcp" && c.transport != "unix") {
    invalid("connector transport must be \"tcp\", \"unix\" or \"fuse\"");
  }
  if (auto it = connector.find("uid"); it != connector.end() && !it->is_null()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() >= UINT32_MAX) {
      invalid("connector uid must be a user id (an integer from 0 to 4294967294)");
    }
    if (c.transport != "unix") invalid("connector uid binds a \"unix\" transport only");
    c.uid = static_cast<uint32_t>(it->get<uint64_t>());
  }
  c.tls = opt_bool(connector, "tls").value_or(false);
  // A distinguished name is longer than most strings; RFC 4514 sets no bound, certificates
  // seldom pass 1 KiB.
  c.tls_dn = opt_string(connector, "tls_dn", kMaxDn);
  if (c.tls_dn) {
    if (c.tls_dn->empty()) invalid("connector tls_dn must not be empty");
    c.tls = true;
  }
  if (c.tls && c.transport == "fuse") {
    invalid("connector tls and tls_dn are for the \"tcp\" and \"unix\" transports");
  }
  c.multi_conn = opt_bool(connector, "multi_conn").value_or(false);
  if (c.multi_conn && c.transport == "fuse") {
    invalid("connector multi_conn is for the \"tcp\" and \"unix\" transports");
  }
  // Cinder's connector properties that shareblk stores and does not use: of their type.
  for (const char* key : {"initiator", "platform", "os_type"}) opt_string(connector, key);
  opt_bool(connector, "multipath");
  c.ip = opt_string(connector, "ip");
  if (c.ip) {
    unsigned char buf[16];
    if (inet_pton(AF_INET, c.ip->c_str(), buf) != 1 &&
        inet_pton(AF_INET6, c.ip->c_str(), buf) != 1) {
      invalid("connector ip '" + *c.ip + "' is not an IP address");
    }
  }
  // A null value means absent (opt_string above): stored, it would read as a value later.
  Json stored = Json::object();
  for (const auto& [key, value] : connector.items()) {
    if (!value.is_null()) stored[key] = value;
  }
  stored["transport"] = c.transport;
  c.stored = stored.dump();
  return c;
}

}  // namespace shareblk::control
