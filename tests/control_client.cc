#include "tests/control_client.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace shareblk::testing {

nlohmann::json rpc(const std::string& socket, const std::string& method,
                   const nlohmann::json& params) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket.c_str(), sizeof addr.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot connect to " + socket);
  }
  std::string line =
      nlohmann::json{{"jsonrpc", "2.0"}, {"id", 1}, {"method", method}, {"params", params}}.dump() +
      "\n";
  ::send(fd, line.data(), line.size(), MSG_NOSIGNAL);
  std::string reply;
  char buf[65536];
  while (reply.find('\n') == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    reply.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return nlohmann::json::parse(reply);
}

nlohmann::json rpc_ok(const std::string& socket, const std::string& method,
                      const nlohmann::json& params) {
  nlohmann::json response = rpc(socket, method, params);
  EXPECT_FALSE(response.contains("error")) << method << ": " << response.dump();
  return response.value("result", nlohmann::json());
}

std::string rpc_reason(const std::string& socket, const std::string& method,
                       const nlohmann::json& params) {
  nlohmann::json response = rpc(socket, method, params);
  if (!response.contains("error")) return "";
  return response["error"]["data"].value("reason", "");
}

}  // namespace shareblk::testing
