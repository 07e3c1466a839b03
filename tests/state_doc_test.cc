// docs/state.md's schema of the state database against the one a fresh database has.
//
// "The database" in docs/state.md shows the schema as SQL (```sql blocks, with comments and a
// layout of their own). This test keeps it and control/db.cc in step: every table, column,
// constraint and index of a database the control plane has just created is in the document,
// each table's columns in their order, and the document shows nothing else, so that a change to
// the schema fails here until the document shows it. Layout and comments do not count.
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <cctype>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "control/control.h"
#include "control/db.h"
#include "tests/fake_volume_store.h"
#include "tests/support.h"

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

bool is_punctuation(char c) {
  return c == '(' || c == ')' || c == ',' || c == ';';
}

// The end of the quoted text that starts at `at` ('...' or "...", the quote doubled inside).
size_t end_of_quoted(const std::string& sql, size_t at) {
  const char quote = sql[at];
  size_t i = at + 1;
  for (;;) {
    i = sql.find(quote, i);
    if (i == std::string::npos) return sql.size();
    if (i + 1 < sql.size() && sql[i + 1] == quote) {
      i += 2;
      continue;
    }
    return i + 1;
  }
}

// SQL without its comments, its white space made canonical, quoted text left as it is: one
// space after a comma and between a closing parenthesis and a word, none before ( ) , ; or
// after ( ;, and one wherever the text had white space or a comment between two words. Two
// texts that differ only in layout and comments come out the same.
std::string canonical(const std::string& sql) {
  std::string out;
  bool space = false;  // white space or a comment since the last character kept
  auto keep = [&](const std::string& token) {
    if (!out.empty() && !is_punctuation(token[0])) {
      const char before = out.back();
      if (before == ',' || before == ')' || (space && !is_punctuation(before))) out += ' ';
    }
    out += token;
    space = false;
  };
  for (size_t i = 0; i < sql.size();) {
    const char c = sql[i];
    if (c == '\'' || c == '"') {
      const size_t end = end_of_quoted(sql, i);
      keep(sql.substr(i, end - i));
      i = end;
    } else if (sql.compare(i, 2, "--") == 0) {
      i = sql.find('\n', i);
      if (i == std::string::npos) i = sql.size();
      space = true;
    } else if (sql.compare(i, 2, "/*") == 0) {
      i = sql.find("*/", i + 2);
      i = i == std::string::npos ? sql.size() : i + 2;
      space = true;
    } else if (is_space(c)) {
      ++i;
      space = true;
    } else {
      keep(std::string(1, c));
      ++i;
    }
  }
  return out;
}

// Splits canonical SQL at `separator` outside quotes and parentheses.
std::vector<std::string> split_top_level(const std::string& sql, char separator) {
  std::vector<std::string> parts;
  std::string part;
  int depth = 0;
  for (size_t i = 0; i < sql.size();) {
    const char c = sql[i];
    if (c == '\'' || c == '"') {
      const size_t end = end_of_quoted(sql, i);
      part += sql.substr(i, end - i);
      i = end;
      continue;
    }
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (c == separator && depth == 0) {
      parts.push_back(part);
      part.clear();
    } else {
      part += c;
    }
    ++i;
  }
  parts.push_back(part);
  std::vector<std::string> kept;
  for (const std::string& p : parts) {
    if (!p.empty() && p != " ") kept.push_back(p.front() == ' ' ? p.substr(1) : p);
  }
  return kept;
}

// One CREATE statement: a table's definitions (columns, then table constraints) one by one, in
// order, and for any other object the whole statement.
struct SchemaObject {
  std::string kind;  // "table", "index", "view", "trigger", as sqlite_master's type
  std::vector<std::string> definitions;
  std::string text;  // the whole statement, canonical, for messages
};

// The objects that `sql` (any number of statements) creates, by name.
std::map<std::string, SchemaObject> parse_schema(const std::string& sql) {
  static const std::regex create(
      R"(^CREATE (?:TEMP |TEMPORARY )?(?:UNIQUE )?(TABLE|INDEX|VIEW|TRIGGER) )"
      R"re((?:IF NOT EXISTS )?(?:"([^"]+)"|(\w+)))re",
      std::regex::icase);
  std::map<std::string, SchemaObject> objects;
  for (const std::string& statement : split_top_level(canonical(sql), ';')) {
    std::smatch m;
    if (!std::regex_search(statement, m, create)) {
      ADD_FAILURE() << "not a CREATE statement: " << statement;
      continue;
    }
    SchemaObject object;
    for (char c : std::string(m[1]))
      object.kind += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const std::string name = m[2].matched ? std::string(m[2]) : std::string(m[3]);
    object.text = statement;
    if (object.kind == "table") {
      // CREATE TABLE name(definition, ...) and what follows the parenthesis (WITHOUT ROWID).
      const size_t open = statement.find('(', m.length(0));
      const size_t close = statement.rfind(')');
      if (open == std::string::npos || close == std::string::npos || close < open) {
        ADD_FAILURE() << "a table without definitions: " << statement;
        continue;
      }
      object.definitions = split_top_level(statement.substr(open + 1, close - open - 1), ',');
      const std::string after = statement.substr(close + 1);
      if (!after.empty()) object.definitions.push_back(")" + after);
    } else {
      object.definitions = {statement};
    }
    EXPECT_EQ(objects.count(name), 0u) << name << " is created twice";
    objects[name] = object;
  }
  return objects;
}

// What "The database" section of docs/state.md says: its SQL, and the schema version it names.
struct StateDoc {
  std::string sql;  // every ```sql block of the section, one after the other
  int version = -1;
};

StateDoc read_state_doc() {
  std::ifstream in(std::string(SHAREBLK_DOCS_DIR) + "/state.md");
  EXPECT_TRUE(in.good()) << "docs/state.md is missing";
  const std::regex version(R"(PRAGMA user_version = (\d+))");
  StateDoc doc;
  bool in_section = false;
  bool in_sql = false;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("## ")) in_section = line.starts_with("## The database");
    if (!in_section) continue;
    if (line.starts_with("```")) {
      in_sql = !in_sql && line == "```sql";
      continue;
    }
    if (in_sql) {
      doc.sql += line + "\n";
      continue;
    }
    std::smatch m;
    if (doc.version < 0 && std::regex_search(line, m, version)) doc.version = std::stoi(m[1]);
  }
  return doc;
}

// A database the control plane has just created: its CREATE statements, as sqlite_master
// keeps them (SQLite's own objects left out), and its user_version.
struct FreshDatabase {
  std::vector<std::string> statements;
  int version = -1;
};

FreshDatabase fresh_database() {
  shareblk::testing::TempDir dir;
  shareblk::testing::FakeVolumeStore store;
  const std::string path = dir / "shareblk.db";
  { shareblk::control::ControlPlane plane(path, store, {}); }
  FreshDatabase fresh;
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
    ADD_FAILURE() << "cannot open " << path << ": " << sqlite3_errmsg(db);
    sqlite3_close(db);
    return fresh;
  }
  auto each_row = [&](const char* sql, auto&& row) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr) != SQLITE_OK) {
      ADD_FAILURE() << sql << ": " << sqlite3_errmsg(db);
      return;
    }
    while (sqlite3_step(stmt) == SQLITE_ROW) row(stmt);
    sqlite3_finalize(stmt);
  };
  each_row(
      "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite\\_%' "
      "ESCAPE '\\' ORDER BY rowid",
      [&](sqlite3_stmt* s) {
        fresh.statements.push_back(reinterpret_cast<const char*>(sqlite3_column_text(s, 0)));
      });
  each_row("PRAGMA user_version",
           [&](sqlite3_stmt* s) { fresh.version = sqlite3_column_int(s, 0); });
  sqlite3_close(db);
  return fresh;
}

std::string joined(const std::vector<std::string>& lines, const std::string& indent) {
  std::string out;
  for (const std::string& line : lines) out += indent + line + "\n";
  return out;
}

TEST(StateDoc, ShowsEveryTableColumnConstraintAndIndexOfAFreshDatabase) {
  const StateDoc doc = read_state_doc();
  ASSERT_FALSE(doc.sql.empty()) << "no ```sql block in docs/state.md, \"The database\"";
  const FreshDatabase fresh = fresh_database();
  ASSERT_FALSE(fresh.statements.empty()) << "the fresh database has no schema";
  std::string stored;  // the schema as SQLite keeps it, for the messages
  for (const std::string& statement : fresh.statements) stored += statement + ";\n";

  const std::map<std::string, SchemaObject> documented = parse_schema(doc.sql);
  const std::map<std::string, SchemaObject> actual = parse_schema(stored);
  EXPECT_GE(actual.size(), 4u) << stored;
  for (const auto& [name, object] : actual) {
    SCOPED_TRACE(object.kind + " " + name);
    auto it = documented.find(name);
    if (it == documented.end()) {
      ADD_FAILURE() << "docs/state.md does not show the " << object.kind << " " << name
                    << "; the database has:\n"
                    << object.text;
      continue;
    }
    EXPECT_EQ(it->second.kind, object.kind);
    EXPECT_EQ(it->second.definitions, object.definitions)
        << "docs/state.md shows:\n"
        << joined(it->second.definitions, "  ") << "a fresh database has:\n"
        << joined(object.definitions, "  ") << "as SQLite keeps it:\n"
        << stored;
  }
  for (const auto& [name, object] : documented) {
    EXPECT_EQ(actual.count(name), 1u) << "docs/state.md shows the " << object.kind << " " << name
                                      << ", which a fresh database does not have:\n"
                                      << stored;
  }
}

TEST(StateDoc, NamesTheSchemaVersionOfAFreshDatabase) {
  const StateDoc doc = read_state_doc();
  const FreshDatabase fresh = fresh_database();
  EXPECT_EQ(fresh.version, shareblk::control::kSchemaVersion);
  EXPECT_EQ(doc.version, fresh.version)
      << "docs/state.md, \"The database\": `PRAGMA user_version = N` names another version";
}

// The comparison above sees through layout and comments, and nothing else.
TEST(StateDoc, LayoutAndCommentsDoNotCountButEveryTokenDoes) {
  const std::string tidy = "CREATE TABLE t (a TEXT NOT NULL, b INTEGER CHECK (b IN (1, 2)));";
  const std::string laid_out = R"(CREATE TABLE t (
  a   TEXT NOT NULL,  -- a comment, with (parentheses); and 'quotes'
  b   INTEGER CHECK (b IN
        (1, 2))       /* another */
);)";
  const auto expected = std::vector<std::string>{"a TEXT NOT NULL", "b INTEGER CHECK(b IN(1, 2))"};
  EXPECT_EQ(parse_schema(tidy).at("t").definitions, expected);
  EXPECT_EQ(parse_schema(laid_out).at("t").definitions, expected);
  // What SQLite keeps after ALTER TABLE ADD COLUMN: the column after the last one's line.
  EXPECT_EQ(parse_schema("CREATE TABLE t (\n  a TEXT NOT NULL\n, b INTEGER CHECK (b IN (1, 2)))")
                .at("t")
                .definitions,
            expected);
  EXPECT_NE(
      parse_schema("CREATE TABLE t (a TEXT, b INTEGER CHECK (b IN (1, 2)))").at("t").definitions,
      expected);
  EXPECT_NE(parse_schema("CREATE TABLE t (a TEXT NOT NULL, b INTEGER CHECK (b IN (1, 3)))")
                .at("t")
                .definitions,
            expected);
  // Quoted text is kept as it is.
  EXPECT_NE(canonical("DEFAULT 'a  b'"), canonical("DEFAULT 'a b'"));
  EXPECT_EQ(canonical("DEFAULT 'a -- b'"), "DEFAULT 'a -- b'");
  // Indexes compare whole.
  EXPECT_EQ(parse_schema("CREATE INDEX i ON t(a);").at("i").definitions,
            parse_schema("CREATE INDEX i ON t (a)").at("i").definitions);
  EXPECT_NE(parse_schema("CREATE INDEX i ON t(a)").at("i").definitions,
            parse_schema("CREATE INDEX i ON t(b)").at("i").definitions);
}

}  // namespace
