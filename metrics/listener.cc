// GET /metrics over HTTP, with cpp-httplib: a plain request/response server is all Prometheus
// needs, and the library parses HTTP so that we do not. Only GET /metrics answers 200.
#include <httplib.h>
#include <spdlog/spdlog.h>

#include <thread>

#include "metrics/metrics.h"

namespace shareblk::metrics {

struct Listener::Impl {
  std::function<std::string()> body;
  httplib::Server server;
  std::thread thread;
};

Listener::Listener(std::function<std::string()> body) : impl_(std::make_unique<Impl>()) {
  impl_->body = std::move(body);
}

Listener::~Listener() {
  stop();
}

std::error_code Listener::start(const std::string& endpoint, std::string& bound,
                                std::string& what) {
  const size_t colon = endpoint.rfind(':');
  int port = -1;
  if (colon != std::string::npos) {
    try {
      size_t used = 0;
      port = std::stoi(endpoint.substr(colon + 1), &used);
      if (used != endpoint.size() - colon - 1) port = -1;
    } catch (const std::exception&) {
      port = -1;
    }
  }
  if (port < 0 || port > 65535) {
    what = "--metrics-listen wants ADDR:PORT, not '" + endpoint + "'";
    return std::make_error_code(std::errc::invalid_argument);
  }
  std::string host = endpoint.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  Impl& s = *impl_;
  // Scrapes are rare and small: two threads serve them (the library's default is one per CPU).
  s.server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  s.server.Get("/metrics", [&s](const httplib::Request&, httplib::Response& res) {
    try {
      res.set_content(s.body(), "text/plain; version=0.0.4; charset=utf-8");
    } catch (const std::exception& e) {
      spdlog::error("metrics: {}", e.what());
      res.status = 500;
      res.set_content(std::string(e.what()) + "\n", "text/plain");
    }
  });
  if (port == 0) {
    port = s.server.bind_to_any_port(host);
  } else if (!s.server.bind_to_port(host, port)) {
    port = -1;
  }
  if (port < 0) {
    what = "metrics listener " + endpoint;
    return std::error_code(errno != 0 ? errno : EADDRNOTAVAIL, std::generic_category());
  }
  bound =
      (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
  s.thread = std::thread([&s] { s.server.listen_after_bind(); });
  return {};
}

void Listener::stop() {
  if (!impl_->thread.joinable()) return;
  impl_->server.stop();
  impl_->thread.join();
}

}  // namespace shareblk::metrics
