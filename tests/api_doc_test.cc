// docs/api.md is the API's contract: this test keeps it and the method table in step, so a
// method, a param or an error code cannot change in one without the other.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "control/jsonrpc.h"
#include "control/methods.h"

namespace {

struct MethodDoc {
  std::string name;
  std::set<std::string> params;
  std::set<std::string> reasons;  // named in its "Errors:" sentence
};

struct ApiDoc {
  std::vector<MethodDoc> methods;
  std::map<std::string, int> codes;          // the Errors table
  std::map<std::string, std::string> roles;  // the Roles table: method -> "admin" or "read"
};

ApiDoc read_api_doc() {
  std::ifstream in(std::string(SHAREBLK_DOCS_DIR) + "/api.md");
  EXPECT_TRUE(in.good()) << "docs/api.md is missing";
  const std::regex section(R"(^## (.+)$)");
  const std::regex method(R"(^### `(\w+)`$)");
  const std::regex table_row(R"(^\| `(\w+)` \| ([^|]+) \|)");
  const std::regex reason(R"(`(\w+)`)");
  ApiDoc doc;
  std::string current;
  bool in_errors_sentence = false;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, section)) {
      current = m[1];
      continue;
    }
    if (current == "Errors" && std::regex_search(line, m, table_row)) {
      doc.codes[m[1]] = std::stoi(m[2]);
      continue;
    }
    if (current == "Roles" && std::regex_search(line, m, table_row)) {
      doc.roles[m[1]] = std::regex_replace(std::string(m[2]), std::regex(" +$"), "");
      continue;
    }
    if (current != "Methods") continue;
    if (std::regex_match(line, m, method)) {
      doc.methods.push_back({m[1], {}, {}});
      in_errors_sentence = false;
      continue;
    }
    if (doc.methods.empty()) continue;
    if (std::regex_search(line, m, table_row)) {
      doc.methods.back().params.insert(m[1]);
      continue;
    }
    // "Errors: `a`, `b`." may wrap onto the next lines, until a blank line.
    auto at = line.find("Errors:");
    if (at != std::string::npos) in_errors_sentence = true;
    if (line.empty()) in_errors_sentence = false;
    if (in_errors_sentence) {
      const std::string tail = at == std::string::npos ? line : line.substr(at);
      for (std::sregex_iterator it(tail.begin(), tail.end(), reason), end; it != end; ++it) {
        doc.methods.back().reasons.insert((*it)[1]);
      }
    }
  }
  return doc;
}

TEST(ApiDoc, DocumentsEveryMethodOfTheTableInItsOrder) {
  const ApiDoc doc = read_api_doc();
  std::vector<std::string> documented;
  for (const auto& m : doc.methods) documented.push_back(m.name);
  std::vector<std::string> served;
  for (const auto& m : shareblk::control::method_table()) served.emplace_back(m.name);
  EXPECT_EQ(documented, served);
}

TEST(ApiDoc, DocumentsExactlyTheParamsEachMethodAccepts) {
  for (const auto& m : read_api_doc().methods) {
    const auto* method = shareblk::control::find_method(m.name);
    if (method == nullptr) continue;  // the test above says so
    std::set<std::string> accepted(method->params.begin(), method->params.end());
    EXPECT_EQ(m.params, accepted) << m.name;
  }
}

TEST(ApiDoc, ErrorReasonsAndCodesAreTheServers) {
  const ApiDoc doc = read_api_doc();
  EXPECT_EQ(doc.codes.size(), 17u);  // forbidden (least authority) is the 17th
  for (const auto& [reason, code] : doc.codes) {
    EXPECT_EQ(shareblk::control::code_for(reason), code) << reason;
  }
  for (const auto& m : doc.methods) {
    EXPECT_FALSE(m.reasons.empty()) << m.name << " names no error";
    for (const auto& reason : m.reasons) {
      EXPECT_EQ(doc.codes.count(reason), 1u) << m.name << " names unknown reason " << reason;
    }
  }
}

// Who may call each method is said once, in the method table, and documented once, in the
// Roles table: the two agree, and every method is in both.
TEST(ApiDoc, TheRolesTableIsTheMethodTables) {
  const ApiDoc doc = read_api_doc();
  std::map<std::string, std::string> served;
  for (const auto& m : shareblk::control::method_table()) {
    served[std::string(m.name)] = m.role == shareblk::control::Role::Read ? "read" : "admin";
  }
  EXPECT_EQ(doc.roles, served);
}

}  // namespace
