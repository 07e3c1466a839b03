#include "cmd/json_log.h"

#include <spdlog/details/log_msg.h>

#include <nlohmann/json.hpp>

#include "text/iso_time.h"

namespace shareblk {

namespace {

class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const std::string time = iso8601_utc(msg.time);
    const auto level = spdlog::level::to_string_view(msg.level);
    const nlohmann::json line{{"time", time},
                              {"level", std::string(level.data(), level.size())},
                              {"thread", msg.thread_id},
                              {"message", std::string(msg.payload.data(), msg.payload.size())}};
    const std::string text =
        line.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
    dest.append(text.data(), text.data() + text.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

std::unique_ptr<spdlog::formatter> json_log_formatter() {
  return std::make_unique<JsonFormatter>();
}

}  // namespace shareblk
