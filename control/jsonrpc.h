// Internal to control/: JSON-RPC 2.0 framing (https://www.jsonrpc.org/specification). A line
// holds one request or a batch; the reply line holds the response(s), or nothing when only
// notifications came. Every error carries data.reason (docs/api.md, "Errors").
#pragma once

#include <string>

#include "control/service.h"

namespace shareblk::control {

// JSON-RPC's own codes; the API's reasons have their own codes (docs/api.md).
inline constexpr int kParseError = -32700;
inline constexpr int kInvalidRequest = -32600;
inline constexpr int kMethodNotFound = -32601;

// A batch holds at most this many requests; a reply line at most this many bytes (a batch's
// reply: plus one short error for each request past it, which is then not run).
inline constexpr size_t kMaxBatch = 256;
inline constexpr size_t kMaxReplyLine = 16 << 20;

// The error code of an API reason.
int code_for(const std::string& reason);

// An error response with "id": null, for a line that has no usable id.
std::string error_line(int code, const std::string& reason, const std::string& message);

// Decodes `line`, runs each request through the method table and encodes the responses.
// A response's id is its request's as sent: a number keeps its text (2^64, 1.50, -0), which
// a parse and a dump would change. Never throws: a failing method is an error response.
std::string handle_line(const std::string& line, Service& service, const Caller& caller);

}  // namespace shareblk::control
