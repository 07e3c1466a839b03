#include "cmd/daemon_log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>

namespace shareblk::cmd {
namespace {

// A file sink that can open its file again under the same name. The logger keeps this one
// sink for life: replacing the default logger while other threads log through it would race.
// A reopen that fails keeps the file it had, so the log never points nowhere.
class ReopenableFile final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit ReopenableFile(std::string path) : path_(std::move(path)) {}
  ~ReopenableFile() override {
    if (file_ != nullptr) std::fclose(file_);
  }
  ReopenableFile(const ReopenableFile&) = delete;
  ReopenableFile& operator=(const ReopenableFile&) = delete;

  bool reopen(std::string& error) {
    std::FILE* fresh = std::fopen(path_.c_str(), "ae");
    if (fresh == nullptr) {
      error = "cannot open " + path_ + ": " + std::strerror(errno);
      return false;
    }
    std::lock_guard lock(mutex_);
    if (file_ != nullptr) std::fclose(file_);
    file_ = fresh;
    return true;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::fwrite(formatted.data(), 1, formatted.size(), file_);
  }
  void flush_() override { std::fflush(file_); }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

std::shared_ptr<ReopenableFile> g_file;  // set once, at start, before any other thread runs

}  // namespace

bool log_to(const std::string& file, std::string& error) {
  if (file.empty()) return true;
  auto sink = std::make_shared<ReopenableFile>(file);
  if (!sink->reopen(error)) return false;
  g_file = sink;
  auto logger = std::make_shared<spdlog::logger>("shareblkd", g_file);
  logger->set_level(spdlog::get_level());
  // Few lines (connections, calls, not requests): each is on disk at once, for an operator
  // reading along and for the lines before a crash.
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(logger);
  return true;
}

bool reopen_log(std::string& error) {
  return !g_file || g_file->reopen(error);
}

}  // namespace shareblk::cmd
