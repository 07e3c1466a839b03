// Internal to control/: decoding a call's params, strictly. An unknown key, a missing one or a
// value of the wrong type is ApiError("invalid_params") naming the key: an unknown key is more
// likely a typo than an intent (README "Choices").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "backend/backend.h"
#include "control/db.h"      // WriterPolicy
#include "text/printable.h"  // printable(): caller strings in log lines

namespace shareblk::control {

using Json = nlohmann::json;

// A volume's name is 1 to this many bytes.
inline constexpr size_t kMaxVolumeName = 255;
// Any other string a caller gives is at most this many bytes (a mountpoint: PATH_MAX), and
// none may hold a NUL: SQLite's text and C's strings would end it there.
inline constexpr size_t kMaxText = 255;
inline constexpr size_t kMaxDn = 1024;  // connector tls_dn
inline constexpr size_t kMaxPath = 4096;

// Refuses any key of `p` not in `keys`.
void only_keys(const Json& p, std::span<const std::string_view> keys);
// A non-empty string of at most `max_bytes`, without NUL.
std::string need_string(const Json& p, const char* key, size_t max_bytes = kMaxText);
// Absent or null: nullopt. Otherwise a string of at most `max_bytes`, without NUL.
std::optional<std::string> opt_string(const Json& p, const char* key, size_t max_bytes = kMaxText);
std::optional<bool> opt_bool(const Json& p, const char* key);
// "rw" (the default when absent) or "ro".
backend::AttachMode opt_mode(const Json& p, const char* key);
// Absent or null: nullopt; else "multi" or "single".
std::optional<WriterPolicy> opt_writer_policy(const Json& p, const char* key);

// Bytes, or a string with a K/M/G/T suffix (powers of 1024): a positive multiple of 512,
// at most 2^62.
uint64_t parse_size(const Json& v);
// The size at `key`, which must be present.
uint64_t need_size(const Json& p, const char* key);

// A connector (Cinder's connector properties, plus shareblk's transport and mountpoint), with
// its fields checked; `stored` is what is kept (JSON text): nulls dropped, the transport
// filled in.
struct Connector {
  std::string host;
  std::string transport;   // "tcp" (default), "unix" or "fuse"
  std::string mountpoint;  // fuse only: an absolute path
  std::optional<std::string> ip;
  std::optional<uint32_t> uid;        // unix only: the one local user admitted
  bool tls = false;                   // tcp/unix: the export is TLS-only, with a PSK of its own
  std::optional<std::string> tls_dn;  // tcp/unix: only this x509 client DN (implies tls)
  // tcp/unix: several NBD connections at once (NBD_FLAG_CAN_MULTI_CONN); else a new one
  // replaces the older ones (target::Export::exclusive).
  bool multi_conn = false;
  std::string stored;
};
Connector decode_connector(const Json& connector);

}  // namespace shareblk::control
