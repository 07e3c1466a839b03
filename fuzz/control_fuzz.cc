// Fuzzes the control plane: JSON-RPC framing, batches, params decoding and every method, on
// the path a control-socket line takes (control::handle_line, as serve_client() calls it).
//
// The input is lines, each one what a client sends on the socket, run in order against one
// Service on a real SQLite database (in a private directory on tmpfs) and a FuzzStore. Two
// things in a line are the harness's, not the daemon's:
//   - "@v0" .. "@v9", "@a0" .. "@a9", "@e0" .. "@e9" are replaced by the id of a volume or an
//     attachment, or an export name, that an earlier line of the same input made (in the order
//     they were made, counted round), so that inputs reach past not_found;
//   - a line "!" KIND [ERR] makes the store's next call of that kind fail: KIND is c(reate),
//     e(xtend), r(emove), o(pen), f (refresh) or l(ist); ERR is n (ENOSPC, the default), i
//     (EIO), x (EEXIST) or o (ENOENT).
// Lines that name the "fuse" transport are skipped: a FUSE attachment mounts where its
// connector says, and a fuzzer must not mount over the machine's directories. So are lines
// that name "state_backup", which writes a file wherever its path says, and volume_create's
// "from_image", which runs qemu-img on a file of the machine.
//
// Every reply must be JSON-RPC 2.0: one response per request that is not a notification, each
// with a usable id, a result or an error with a documented code and reason, and "internal" or
// "volume_error" only when the input made the store fail. After the input, its volumes and
// attachments are deleted through the API, which must succeed and leave nothing behind (no row, no
// backing, no volume lock, no subscription): the next input starts from where this one did.
// CONTROL_FUZZ_TRACE=1 in the environment prints each line and its reply.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "control/jsonrpc.h"
#include "control/service.h"
#include "fuzz/fuzz_store.h"

namespace shareblk::fuzz {
namespace {

using Json = nlohmann::json;

[[noreturn]] void fail(const std::string& what, const std::string& detail = "") {
  std::fprintf(stderr, "control_fuzz: %s\n%s\n", what.c_str(), detail.c_str());
  std::abort();
}

// Takes the revocation notices export_resolve's callers get; each must be a request without id.
class Subscriber final : public control::Subscriber {
 public:
  void notify(const std::string& line) override {
    const Json notice = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!notice.is_object() || notice.contains("id") ||
        notice.value("method", "") != "attachment_revoked" ||
        !notice["params"]["attachment_id"].is_string()) {
      fail("a malformed notice", line);
    }
  }
};

struct Environment {
  Environment() : dir(make_dir()) {
    spdlog::set_level(spdlog::level::off);
    service = std::make_unique<control::Service>((dir / "shareblk.db").string(), store,
                                                 control::Policy{});
    service->bind(nullptr, {(dir / "nbd.sock").string(), "127.0.0.1:10809"});
    caller.pid = 1234;
    caller.uid = 1000;
    caller.subscriber = subscriber;
  }

  static std::filesystem::path make_dir() {
    std::string base = "/dev/shm";
    if (::access(base.c_str(), W_OK) != 0) {
      const char* tmp = std::getenv("TMPDIR");
      base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    }
    std::string path = base + "/shareblk-control-fuzz-XXXXXX";
    if (::mkdtemp(path.data()) == nullptr) fail("mkdtemp failed");
    return path;
  }

  std::filesystem::path dir;
  FuzzStore store;
  std::unique_ptr<control::Service> service;
  std::shared_ptr<Subscriber> subscriber = std::make_shared<Subscriber>();
  control::Caller caller;
  // CONTROL_FUZZ_TRACE=1: each line and its reply on stderr, to read what a reproducer does.
  const bool trace = std::getenv("CONTROL_FUZZ_TRACE") != nullptr;
};

Environment& environment() {
  // Made once and never freed: every input runs against the same Service, which the end of
  // each input empties again. Its directory goes at exit.
  static Environment* env = [] {
    auto* e = new Environment();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(environment().dir, ec);
    });
    return e;
  }();
  return *env;
}

// What earlier lines of this input made, for the @ placeholders.
struct Made {
  std::vector<std::string> volumes, attachments, exports;
  bool store_failed = false;  // a "!" line ran: "internal" and "volume_error" are then fair
};

void substitute(std::string& line, const Made& made) {
  static const std::string kNone = "00000000-0000-4000-8000-000000000000";
  for (size_t at = 0; (at = line.find('@', at)) != std::string::npos;) {
    if (at + 2 >= line.size() || line[at + 2] < '0' || line[at + 2] > '9') {
      ++at;
      continue;
    }
    const std::vector<std::string>* from = nullptr;
    switch (line[at + 1]) {
      case 'v':
        from = &made.volumes;
        break;
      case 'a':
        from = &made.attachments;
        break;
      case 'e':
        from = &made.exports;
        break;
      default:
        ++at;
        continue;
    }
    const size_t n = static_cast<size_t>(line[at + 2] - '0');
    const std::string& value = from->empty() ? kNone : (*from)[n % from->size()];
    line.replace(at, 3, value);
    at += value.size();
  }
}

void inject(std::string_view line, Made& made) {
  using Call = FuzzStore::Call;
  Call call;
  switch (line.size() > 1 ? line[1] : '\0') {
    case 'c':
      call = Call::Create;
      break;
    case 'e':
      call = Call::Extend;
      break;
    case 'r':
      call = Call::Remove;
      break;
    case 'o':
      call = Call::Open;
      break;
    case 'f':
      call = Call::Refresh;
      break;
    case 'l':
      call = Call::List;
      break;
    default:
      return;
  }
  int err = ENOSPC;
  switch (line.size() > 2 ? line[2] : '\0') {
    case 'i':
      err = EIO;
      break;
    case 'x':
      err = EEXIST;
      break;
    case 'o':
      err = ENOENT;
      break;
    default:
      break;
  }
  environment().store.fail_next(call, err);
  made.store_failed = true;
}

// Whether a line holds the string "fuse" (a connector's transport) or "state_backup" (a
// method) anywhere as a value, or "from_image" as a key.
class UnsafeFinder final : public nlohmann::json_sax<Json> {
 public:
  bool found = false;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t& v) override {
    found = found || v == "fuse" || v == "state_backup";
    return !found;
  }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t& k) override {
    found = found || k == "from_image";  // runs qemu-img on a path of the daemon's host
    return !found;
  }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }
};

bool names_unsafe(const std::string& line) {
  // Without these, no JSON string in the line can be either: most lines need no second parse.
  if (line.find("fuse") == std::string::npos && line.find("state_backup") == std::string::npos &&
      line.find("from_image") == std::string::npos && line.find("\\u") == std::string::npos) {
    return false;
  }
  UnsafeFinder finder;
  Json::sax_parse(line, &finder);
  return finder.found;
}

void keep(std::vector<std::string>& list, const Json& v) {
  if (v.is_string() && list.size() < 64) list.push_back(v.get<std::string>());
}

// Checks one response and notes what it made.
void check_response(const Json& r, const std::string& reply, Made& made) {
  static const std::string_view kReasons[] = {"invalid_params",
                                              "internal",
                                              "not_found",
                                              "volume_in_use",
                                              "not_multiattach",
                                              "attachment_id_required",
                                              "duplicate_attachment",
                                              "policy_denied",
                                              "invalid_state",
                                              "no_space",
                                              "volume_error",
                                              "not_single_writer",
                                              "already_writer",
                                              "volume_busy"};
  if (!r.is_object() || r.size() != 3 || r.value("jsonrpc", Json()) != "2.0") {
    fail("a response that is not JSON-RPC 2.0", reply);
  }
  const auto id = r.find("id");
  if (id == r.end() || !(id->is_null() || id->is_string() || id->is_number())) {
    fail("a response without a usable id", reply);
  }
  if (auto result = r.find("result"); result != r.end()) {
    if (result->is_object() && result->contains("id")) {
      if (result->contains("volume_id")) {
        keep(made.attachments, (*result)["id"]);
        const Json& info = (*result)["connection_info"];
        if (info.is_object()) keep(made.exports, info["data"]["export_name"]);
      } else if (result->contains("size")) {
        keep(made.volumes, (*result)["id"]);
      }
    }
    return;
  }
  const auto error = r.find("error");
  if (error == r.end() || !error->is_object() || !(*error)["code"].is_number_integer() ||
      !(*error)["message"].is_string() || !(*error)["data"]["reason"].is_string()) {
    fail("a response with neither a result nor a well-formed error", reply);
  }
  const std::string reason = (*error)["data"]["reason"].get<std::string>();
  const int code = (*error)["code"].get<int>();
  bool known = false;
  for (std::string_view k : kReasons) known = known || reason == k;
  if (!known) fail("an undocumented reason", reply);
  const bool framing = (code == control::kParseError || code == control::kInvalidRequest) &&
                       reason == "invalid_params";
  const bool no_method = code == control::kMethodNotFound && reason == "not_found";
  if (code != control::code_for(reason) && !framing && !no_method) {
    fail("a code that is not its reason's", reply);
  }
  // Both need the store to have failed: a store error, or a delete it left unfinished (the
  // volume's status is then error, and attaching it is refused with volume_error).
  if ((reason == "internal" || reason == "volume_error") && !made.store_failed) {
    fail("\"" + reason + "\" without a store failure", reply);
  }
}

void check_reply(const std::string& line, const std::string& reply, Made& made) {
  if (reply.empty()) return;  // notifications only (or a line the daemon does not answer)
  if (reply.find('\n') != std::string::npos) fail("a reply of more than one line", reply);
  const Json parsed = Json::parse(reply, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) fail("a reply that is not JSON", line + "\n-> " + reply);
  if (parsed.is_array()) {
    if (parsed.empty()) fail("an empty batch reply", reply);
    for (const Json& r : parsed) check_response(r, reply, made);
  } else {
    check_response(parsed, reply, made);
  }
}

// Runs one control-plane call of the harness's own; it must succeed.
Json call(const std::string& method, const Json& params) {
  Environment& env = environment();
  const Json request{{"jsonrpc", "2.0"}, {"id", 1}, {"method", method}, {"params", params}};
  const std::string reply = control::handle_line(request.dump(), *env.service, env.caller);
  const Json parsed = Json::parse(reply, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object() || !parsed.contains("result")) {
    fail("cleaning up: " + method + " " + params.dump() + " failed", reply);
  }
  return parsed["result"];
}

// Deletes every attachment and volume through the API, and checks nothing is left.
void clean_up(const Made& made) {
  Environment& env = environment();
  env.store.clear_failures();
  // A volume_delete returns before its backing is gone (a job finishes it): wait for those.
  for (int tries = 0; env.service->counts().running_jobs != 0; ++tries) {
    if (tries == 10000) fail("a volume's job never finished");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // A job that has just finished may still hold its volume's lock for a moment.
  for (int tries = 0; env.service->counts().volume_locks != 0; ++tries) {
    if (tries == 5000) fail("a volume lock outlived its call");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Every volume has its backing made first and removed first (unless the store failed), and
  // every attachment needs a volume: with no backing left there is nothing to delete.
  if (env.store.volume_count() == 0 && !made.store_failed) {
    if (env.service->counts().subscribers != 0) fail("a subscription outlived its attachment");
    return;
  }
  for (const Json& a : call("attachment_list", Json::object())) {
    if (a["attach_status"] != "detached") call("attachment_delete", {{"attachment_id", a["id"]}});
  }
  for (const Json& v : call("volume_list", Json::object())) {
    call("volume_delete", {{"volume_id", v["id"]}, {"wait", true}});
  }
  if (!call("volume_list", Json::object()).empty()) fail("volumes left after deleting them all");
  if (!call("attachment_list", Json::object()).empty()) {
    fail("attachments left after deleting every volume");
  }
  if (env.store.volume_count() != 0) fail("backing left after deleting every volume");
  if (env.service->counts().subscribers != 0) fail("a subscription outlived its attachment");
}

}  // namespace
}  // namespace shareblk::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shareblk::fuzz;  // NOLINT(google-build-using-namespace)
  Environment& env = environment();
  Made made;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  size_t start = 0;
  while (start < input.size()) {
    size_t end = input.find('\n', start);
    if (end == std::string_view::npos) end = input.size();
    std::string line(input.substr(start, end - start));
    start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // as serve_client()
    if (line[0] == '!') {
      inject(line, made);
      continue;
    }
    substitute(line, made);
    if (names_unsafe(line)) continue;
    const std::string reply = shareblk::control::handle_line(line, *env.service, env.caller);
    if (env.trace) std::fprintf(stderr, "> %s\n< %s\n", line.c_str(), reply.c_str());
    check_reply(line, reply, made);
  }
  clean_up(made);
  return 0;
}
