#include "control/jsonrpc.h"

#include <spdlog/spdlog.h>

#include <optional>
#include <utility>

#include "control/methods.h"

namespace shareblk::control {

namespace {

// Nested deeper than this, a line is refused. nlohmann::json copies and dumps values
// recursively: a line of 100,000 nested brackets (200 KB) overflowed the stack of the thread
// that copied its "id".
constexpr int kMaxDepth = 64;

Json error_response(const Json& id, int code, const std::string& reason,
                    const std::string& message) {
  return Json{{"jsonrpc", "2.0"},
              {"id", id},
              {"error", {{"code", code}, {"message", message}, {"data", {{"reason", reason}}}}}};
}

Json invalid_request(const std::string& message) {
  return error_response(nullptr, kInvalidRequest, "invalid_params", message);
}

// One request: its response, or null for a notification (a valid request without "id", which
// is never answered, whatever happens to it). An invalid request is answered with "id": null
// even when it has no "id" (JSON-RPC 2.0, section 5).
Json handle_one(const Json& request, Service& service, const Caller& caller) {
  if (!request.is_object()) return invalid_request("a request is an object");
  const bool notification = !request.contains("id");
  const Json id = notification ? Json(nullptr) : request["id"];
  if (!id.is_null() && !id.is_string() && !id.is_number()) {
    return invalid_request("id must be a string, a number or null");
  }
  // Compared as JSON, not read with value(), which throws when "jsonrpc" is not a string.
  const auto version = request.find("jsonrpc");
  if (version == request.end() || *version != Json("2.0") || !request.contains("method") ||
      !request["method"].is_string()) {
    return error_response(id, kInvalidRequest, "invalid_params",
                          "a request needs \"jsonrpc\": \"2.0\" and a method name");
  }
  auto respond = [&](Json response) { return notification ? Json() : std::move(response); };
  const std::string method = request["method"].get<std::string>();
  const Method* found = find_method(method);
  if (found == nullptr) {
    return respond(
        error_response(id, kMethodNotFound, "not_found", "unknown method '" + method + "'"));
  }
  Json params = request.contains("params") ? request["params"] : Json::object();
  if (params.is_null()) params = Json::object();
  if (!params.is_object()) {
    return respond(error_response(id, code_for("invalid_params"), "invalid_params",
                                  "params must be an object"));
  }
  try {
    only_keys(params, found->params);
    Json result = found->run(service, params, caller);
    spdlog::info("control: uid={} pid={} {}: ok", caller.uid, caller.pid, printable(method));
    return respond(Json{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}});
  } catch (const ApiError& e) {
    spdlog::info("control: uid={} pid={} {}: {} ({})", caller.uid, caller.pid, printable(method),
                 e.reason, printable(e.what(), 1024));  // messages quote the caller's strings
    return respond(error_response(id, code_for(e.reason), e.reason, e.what()));
  } catch (const DbError& e) {
    // The state directory's file system is full: the caller can act on that (free space),
    // unlike on any other database failure.
    const std::string reason = e.disk_full() ? "no_space" : "internal";
    spdlog::error("control: uid={} pid={} {}: {}: {}", caller.uid, caller.pid, printable(method),
                  reason, printable(e.what(), 1024));
    return respond(error_response(id, code_for(reason), reason, e.what()));
  } catch (const std::exception& e) {
    spdlog::error("control: uid={} pid={} {}: internal error: {}", caller.uid, caller.pid,
                  printable(method), printable(e.what(), 1024));
    return respond(error_response(id, code_for("internal"), "internal", e.what()));
  }
}

// The id a response to `request` would carry: nullopt for a notification, null when the
// request's id is unusable.
std::optional<Json> reply_id(const Json& request) {
  if (!request.is_object()) return Json(nullptr);
  auto it = request.find("id");
  if (it == request.end()) return std::nullopt;
  return (it->is_string() || it->is_number()) ? *it : Json(nullptr);
}

std::string too_large(const Json& id, size_t bytes) {
  return error_response(id, code_for("internal"), "internal",
                        "the reply (" + std::to_string(bytes) + " bytes) is over the " +
                            std::to_string(kMaxReplyLine) +
                            " bytes a reply line may hold; ask for less")
      .dump();
}

std::string handle_batch(const Json& batch, Service& service, const Caller& caller) {
  if (batch.empty()) return error_line(kInvalidRequest, "invalid_params", "empty batch");
  if (batch.size() > kMaxBatch) {
    return error_line(kInvalidRequest, "invalid_params",
                      "a batch of " + std::to_string(batch.size()) + " requests; at most " +
                          std::to_string(kMaxBatch));
  }
  std::string out = "[";
  size_t answered = 0;
  bool full = false;  // the reply reached kMaxReplyLine: the rest is not run
  for (const Json& one : batch) {
    std::string text;
    if (full) {
      auto id = reply_id(one);
      if (!id) continue;
      text = error_response(*id, code_for("internal"), "internal",
                            "not run: the batch's reply reached its limit")
                 .dump();
    } else {
      Json response = handle_one(one, service, caller);
      if (response.is_null()) continue;
      text = response.dump();
      if (out.size() + text.size() + 1 > kMaxReplyLine) {
        text = too_large(response["id"], text.size());
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
  };
  for (const auto& [name, code] : kCodes) {
    if (reason == name) return code;
  }
  return -32603;
}

std::string error_line(int code, const std::string& reason, const std::string& message) {
  return error_response(nullptr, code, reason, message).dump();
}

std::string handle_line(const std::string& line, Service& service, const Caller& caller) {
  bool too_deep = false;
  // Returning false drops a value as it is parsed, so nothing deeper than kMaxDepth is built.
  const Json::parser_callback_t limit = [&too_deep](int depth, Json::parse_event_t, Json&) {
    if (depth > kMaxDepth) too_deep = true;
    return !too_deep;
  };
  Json request = Json::parse(line, limit, /*allow_exceptions=*/false);
  if (too_deep) {
    return error_line(kInvalidRequest, "invalid_params",
                      "nested deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  if (request.is_discarded()) return error_line(kParseError, "invalid_params", "not valid JSON");
  if (request.is_array()) return handle_batch(request, service, caller);
  Json response = handle_one(request, service, caller);
  if (response.is_null()) return {};
  std::string text = response.dump();
  return text.size() > kMaxReplyLine ? too_large(response["id"], text.size()) : text;
}

}  // namespace shareblk::control
