// Internal to control/: the JSON-RPC method table. Each method is one short function: decode
// its params (strictly, control/params.h), look up and act (the Service), respond (the JSON the
// Service returns). docs/api.md documents exactly these methods; a test keeps the two in step.
#pragma once

#include <span>
#include <string_view>

#include "control/service.h"

namespace shareblk::control {

struct Method {
  std::string_view name;
  // The keys its params may have; the framing refuses any other before run() is called.
  std::span<const std::string_view> params;
  // Who may call it: Read for what only looks (and then never sees an export name or a key:
  // connection_info is withheld), Admin for everything else (docs/api.md, "Roles").
  Role role;
  Json (*run)(Service& service, const Json& params, const Caller& caller);
};

// Every method, in the order docs/api.md lists them.
std::span<const Method> method_table();
// nullptr for an unknown name.
const Method* find_method(std::string_view name);

}  // namespace shareblk::control
