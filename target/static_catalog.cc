#include "target/server.h"

namespace shareblk::target {

void StaticCatalog::add(const std::string& name, Export exp) {
  if (exp.group.empty()) exp.group = name;
  exports_.emplace_back(name, std::move(exp));
}

ExportCatalog::Lookup StaticCatalog::resolve(const std::string& name, const Peer& /*peer*/) {
  if (name.empty() && exports_.size() == 1) return {exports_.front().second};
  for (const auto& [n, exp] : exports_) {
    if (n == name) return {exp};
  }
  return {};
}

std::vector<std::string> StaticCatalog::listable() {
  std::vector<std::string> names;
  for (const auto& entry : exports_) names.push_back(entry.first);
  return names;
}

}  // namespace shareblk::target
