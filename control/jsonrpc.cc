#include "control/jsonrpc.h"

#include <spdlog/spdlog.h>

#include <optional>
#include <utility>
#include <vector>

#include "control/methods.h"

namespace shareblk::control {

namespace {

// Nested deeper than this, a line is refused. nlohmann::json copies and dumps values
// recursively: a line of 100,000 nested brackets (200 KB) overflowed the stack of the thread
// that copied its "id".
constexpr int kMaxDepth = 64;

// Builds a line's JSON value as nlohmann::json::parse() would, and also keeps what parse()
// loses: the text of each request's id when it is a number. 2^64, 1.5e300 or -0 parsed and
// dumped again come out as 1.8446744073709552e+19, 1.5e+300 and 0, and a client matching
// replies by id would not find its own. Refuses (stops at) a container nested deeper than
// kMaxDepth before building anything inside it.
// NOLINTNEXTLINE(bugprone-exception-escape): its members' constructors (a null Json) do not throw
class LineReader final : public nlohmann::json_sax<Json> {
 public:
  // The line's value (a request, or a batch of them), once read() returned true.
  const Json& value() const { return root_; }
  bool too_deep() const { return too_deep_; }
  // The text of the id of the line's request (index 0), or of a batch's request `i`, when that
  // id is a number; "" otherwise.
  const std::string& number_id(size_t i) const {
    static const std::string kNone;
    return i < number_ids_.size() ? number_ids_[i] : kNone;
  }

  bool read(const std::string& line) { return Json::sax_parse(line, this); }

  bool null() override { return put(Json(nullptr)); }
  bool boolean(bool v) override { return put(Json(v)); }
  bool number_integer(number_integer_t v) override {
    // The lexer reads every integer without a minus sign as unsigned: a signed 0 was "-0".
    return put(Json(v), v == 0 ? "-0" : std::to_string(v));
  }
  bool number_unsigned(number_unsigned_t v) override { return put(Json(v), std::to_string(v)); }
  bool number_float(number_float_t v, const string_t& text) override { return put(Json(v), text); }
  bool string(string_t& v) override { return put(Json(std::move(v))); }
  bool binary(binary_t&) override { return false; }  // not in JSON text
  bool start_object(std::size_t) override { return open(Json::object()); }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return open(Json::array()); }
  bool end_array() override {
    open_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  bool open(Json container) {
    if (open_.size() >= static_cast<size_t>(kMaxDepth)) {
      too_deep_ = true;
      return false;
    }
    open_.push_back(put_value(std::move(container)));
    return true;
  }

  bool put(Json v, std::string number_text = {}) {
    // A request's own member: in the line's object, or in an object of the line's array.
    const bool batch = !open_.empty() && open_.front()->is_array();
    if (open_.size() == (batch ? 2u : 1u) && open_.back()->is_object() && key_ == "id") {
      const size_t request = batch ? open_.front()->size() - 1 : 0;
      if (number_ids_.size() <= request) number_ids_.resize(request + 1);
      number_ids_[request] = std::move(number_text);  // a later "id" replaces an earlier one
    }
    put_value(std::move(v));
    return true;
  }

  // Where `v` went. Only the innermost open container grows, so the pointers to the open ones
  // stay valid.
  Json* put_value(Json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    Json& slot = parent[key_];
    slot = std::move(v);
    return &slot;
  }

  Json root_;
  std::vector<Json*> open_;  // the containers being read, outermost first
  std::string key_;
  std::vector<std::string> number_ids_;
  bool too_deep_ = false;
};

// Text for a reply line. A message may quote what a caller sent, cut short: bytes that are not
// UTF-8 become U+FFFD rather than an exception.
std::string dump(const Json& v) {
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// A response line: `id` is JSON text, `member` "result" or "error".
std::string response(const std::string& id, const char* member, const Json& value) {
  std::string out = R"({"jsonrpc":"2.0","id":)";
  out += id;
  out += ",\"";
  out += member;
  out += "\":";
  out += dump(value);
  out += '}';
  return out;
}

std::string error_response(const std::string& id, int code, const std::string& reason,
                           const std::string& message, const Json& more = nullptr) {
  Json data = more.is_object() ? more : Json::object();
  data["reason"] = reason;
  return response(id, "error", Json{{"code", code}, {"message", message}, {"data", data}});
}

std::string invalid_request(const std::string& message) {
  return error_response("null", kInvalidRequest, "invalid_params", message);
}

// The id a response to `request` carries, as JSON text: the number exactly as it was sent
// (`number_text`), the string, or null when the request has no usable id; nullopt for a
// notification (a request object without "id").
std::optional<std::string> reply_id(const Json& request, const std::string& number_text) {
  if (!request.is_object()) return "null";
  const auto it = request.find("id");
  if (it == request.end()) return std::nullopt;
  if (it->is_number()) return number_text.empty() ? dump(*it) : number_text;
  if (it->is_string()) return dump(*it);
  return "null";
}

// A read-only caller sees everything but what admits a client: each connection_info (export
// names, TLS keys) becomes null, wherever it stands in the result.
void withhold_credentials(Json& value) {
  if (value.is_object()) {
    for (auto& [key, item] : value.items()) {
      if (key == "connection_info") {
        item = nullptr;
      } else {
        withhold_credentials(item);
      }
    }
  } else if (value.is_array()) {
    for (Json& item : value) withhold_credentials(item);
  }
}

struct Reply {
  std::string id;  // JSON text
  std::string line;
};

// One request: its response, or nothing for a notification (a valid request without "id",
// which is never answered, whatever happens to it). An invalid request is answered with
// "id": null even when it has no "id" (JSON-RPC 2.0, section 5).
std::optional<Reply> handle_one(const Json& request, const std::string& number_id, Service& service,
                                const Caller& caller) {
  if (!request.is_object()) return Reply{"null", invalid_request("a request is an object")};
  const auto given = request.find("id");
  const bool notification = given == request.end();
  if (!notification && !given->is_null() && !given->is_string() && !given->is_number()) {
    return Reply{"null", invalid_request("id must be a string, a number or null")};
  }
  const std::string id_text = reply_id(request, number_id).value_or("null");
  // Compared as JSON, not read with value(), which throws when "jsonrpc" is not a string.
  const auto version = request.find("jsonrpc");
  if (version == request.end() || *version != Json("2.0") || !request.contains("method") ||
      !request["method"].is_string()) {
    return Reply{id_text, error_response(id_text, kInvalidRequest, "invalid_params",
                                         "a request needs \"jsonrpc\": \"2.0\" and a method name")};
  }
  auto respond = [&](std::string line) -> std::optional<Reply> {
    if (notification) return std::nullopt;
    return Reply{id_text, std::move(line)};
  };
  const std::string& method = request["method"].get_ref<const std::string&>();
  const Method* found = find_method(method);
  if (found == nullptr) {
    return respond(
        error_response(id_text, kMethodNotFound, "not_found", "unknown method '" + method + "'"));
  }
  if (caller.role < found->role) {
    spdlog::info("control: uid={} pid={} {}: forbidden (read-only role)", caller.uid, caller.pid,
                 printable(method));
    return respond(error_response(id_text, code_for("forbidden"), "forbidden",
                                  "uid " + std::to_string(caller.uid) +
                                      " may only look (its "
                                      "role is read-only); " +
                                      method + " changes state"));
  }
  Json params = request.contains("params") ? request["params"] : Json::object();
  if (params.is_null()) params = Json::object();
  if (!params.is_object()) {
    return respond(error_response(id_text, code_for("invalid_params"), "invalid_params",
                                  "params must be an object"));
  }
  try {
    only_keys(params, found->params);
    // The volumes a call names may be other gateways' (docs/scale-out.md): known before it runs.
    for (const char* key : {"volume_id", "from_volume"}) {
      const std::optional<std::string> id = opt_string(params, key);
      if (id && !id->empty()) service.learn_volume(*id);
    }
    Json result = found->run(service, params, caller);
    if (caller.role == Role::Read) withhold_credentials(result);
    spdlog::info("control: uid={} pid={} {}: ok", caller.uid, caller.pid, printable(method));
    return respond(response(id_text, "result", result));
  } catch (const ApiError& e) {
    spdlog::info("control: uid={} pid={} {}: {} ({})", caller.uid, caller.pid, printable(method),
                 e.reason, printable(e.what(), 1024));  // messages quote the caller's strings
    return respond(error_response(id_text, code_for(e.reason), e.reason, e.what(), e.data));
  } catch (const DbError& e) {
    // The state directory's file system is full: the caller can act on that (free space),
    // unlike on any other database failure.
    const std::string reason = e.disk_full() ? "no_space" : "internal";
    spdlog::error("control: uid={} pid={} {}: {}: {}", caller.uid, caller.pid, printable(method),
                  reason, printable(e.what(), 1024));
    return respond(error_response(id_text, code_for(reason), reason, e.what()));
  } catch (const std::exception& e) {
    spdlog::error("control: uid={} pid={} {}: internal error: {}", caller.uid, caller.pid,
                  printable(method), printable(e.what(), 1024));
    return respond(error_response(id_text, code_for("internal"), "internal", e.what()));
  }
}

std::string too_large(const std::string& id, size_t bytes) {
  return error_response(id, code_for("internal"), "internal",
                        "the reply (" + std::to_string(bytes) + " bytes) is over the " +
                            std::to_string(kMaxReplyLine) +
                            " bytes a reply line may hold; ask for less");
}

std::string handle_batch(const LineReader& reader, Service& service, const Caller& caller) {
  const Json& batch = reader.value();
  if (batch.empty()) return error_line(kInvalidRequest, "invalid_params", "empty batch");
  if (batch.size() > kMaxBatch) {
    return error_line(kInvalidRequest, "invalid_params",
                      "a batch of " + std::to_string(batch.size()) + " requests; at most " +
                          std::to_string(kMaxBatch));
  }
  std::string out = "[";
  size_t answered = 0;
  bool full = false;  // the reply reached kMaxReplyLine: the rest is not run
  for (size_t i = 0; i < batch.size(); ++i) {
    std::string text;
    if (full) {
      auto id = reply_id(batch[i], reader.number_id(i));
      if (!id) continue;
      text = error_response(*id, code_for("internal"), "internal",
                            "not run: the batch's reply reached its limit");
    } else {
      std::optional<Reply> reply = handle_one(batch[i], reader.number_id(i), service, caller);
      if (!reply) continue;
      text = std::move(reply->line);
      if (out.size() + text.size() + 1 > kMaxReplyLine) {
        text = too_large(reply->id, text.size());
        full = true;
      }
    }
    if (answered++ > 0) out += ',';
    out += text;
  }
  out += ']';
  return answered > 0 ? out : std::string();
}

}  // namespace

int code_for(const std::string& reason) {
  static const std::pair<const char*, int> kCodes[] = {
      {"invalid_params", -32602},
      {"internal", -32603},
      {"not_found", -32001},
      {"volume_in_use", -32002},
      {"not_multiattach", -32003},
      {"attachment_id_required", -32004},
      {"duplicate_attachment", -32005},
      {"policy_denied", -32006},
      {"invalid_state", -32007},
      {"no_space", -32008},
      {"volume_error", -32009},
      {"not_single_writer", -32010},
      {"already_writer", -32011},
      {"volume_busy", -32012},
      {"volume_has_snapshots", -32013},
      {"not_supported", -32014},
      {"forbidden", -32015},
  };
  for (const auto& [name, code] : kCodes) {
    if (reason == name) return code;
  }
  return -32603;
}

std::string error_line(int code, const std::string& reason, const std::string& message) {
  return error_response("null", code, reason, message);
}

std::string handle_line(const std::string& line, Service& service, const Caller& caller) {
  LineReader reader;
  const bool read = reader.read(line);
  if (reader.too_deep()) {
    return error_line(kInvalidRequest, "invalid_params",
                      "nested deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  if (!read) return error_line(kParseError, "invalid_params", "not valid JSON");
  if (reader.value().is_array()) return handle_batch(reader, service, caller);
  std::optional<Reply> reply = handle_one(reader.value(), reader.number_id(0), service, caller);
  if (!reply) return {};
  return reply->line.size() > kMaxReplyLine ? too_large(reply->id, reply->line.size())
                                            : std::move(reply->line);
}

}  // namespace shareblk::control
