// The TLS half of a connection's transmission phase (docs/nbd.md, "TLS"): the worker receives
// and sends records on the client's socket, and the connection's GnuTLS session turns them
// into the request stream and its replies into records, in memory (target/tls.h).
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <string_view>

#include "target/worker.h"

namespace shareblk::target {

// TLS: a connection we end tells the client with close_notify (RFC 8446 6.1), if the socket
// has room for it now and no records are half sent; nothing waits for a client that takes
// nothing.
void Connection::say_goodbye() {
  if (!tls_ || send_ == SendState::InFlight || tls_->has_output()) return;
  tls_->close_notify();
  const std::string_view out = tls_->output();
  if (!out.empty()) (void)::send(fd_, out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

void Connection::post_cipher_recv() {
  recv_ = RecvPending::Posted;
  size_t room = 0;
  char* space = tls_->cipher_space(room);
  worker_.ring().recv(fd_, space, room, &cipher_done_);
}

void Connection::on_cipher(int res) {
  if (res == -EINTR || res == -EAGAIN) {
    post_cipher_recv();
    return;
  }
  if (res <= 0) {
    on_recv(res);  // the end or a failure, as without TLS
    return;
  }
  tls_->cipher_received(static_cast<size_t>(res));
  tls_read();
}

void Connection::tls_read() {
  recv_ = RecvPending::Posted;  // the worker's call, or on_cipher()'s: on_recv() follows
  // drain() or abort() came first (Broken comes with Stopped): as if the socket had ended.
  if (receive_ == ReceiveState::Stopped) {
    on_recv(0);
    return;
  }
  // As much of the stream as is here and fits: a 1 MiB payload is many records.
  size_t got = 0;
  const bool failing = socket_ == SocketState::TlsFailing;
  ssize_t n = failing ? -EPROTO : 0;
  while (!failing && got < tls_room_ && (n = tls_->read(tls_into_ + got, tls_room_ - got)) > 0) {
    got += static_cast<size_t>(n);
  }
  // Reading may have made records to send (a TLS 1.3 key update is answered).
  if (tls_->has_output()) send_more();
  if (got > 0) {
    // The bytes before a record that failed are the client's requests all the same; the
    // failure ends the connection at the next read, which recv_into() then does at once.
    if (n < 0 && n != -EAGAIN) socket_ = SocketState::TlsFailing;
    on_recv(static_cast<int>(got));
    return;
  }
  if (n == -EAGAIN) {
    post_cipher_recv();
    return;
  }
  if (n < 0) {
    spdlog::warn("nbd: a client of {} sent a TLS record that fails, disconnecting", group());
    // Nothing more can be encrypted for it either: its replies go unsent, as for a client
    // that is gone. (Not abort(): it may delete this connection; on_recv() closes it.)
    socket_ = SocketState::Broken;
    set_receive(ReceiveState::Stopped);
    drop_replies();
    qos_release(/*answer=*/false);
    ::shutdown(fd_, SHUT_RDWR);
  }
  on_recv(0);  // close_notify, or the record that failed: the stream ends here
}

// With TLS the ciphertext goes out in one buffer, whatever replies it holds: what is still to
// send is sent before more is encrypted, so that a client that takes its replies slowly holds
// at most one batch of them twice (plaintext and records).
void Connection::tls_flush(bool with_others) {
  if (socket_ == SocketState::Broken) return;  // flush() calls it: no send is in flight
  if (!tls_->has_output() && sendq_head_ != nullptr) {
    // At most this much plaintext per batch: the rest waits for the records to leave.
    constexpr size_t kBatchBytes = 256 * 1024;
    int n = 0;
    size_t bytes = 0;
    for (Request* r = sendq_head_; r != nullptr && bytes < kBatchBytes && n < kMaxSendIov;
         r = r->next) {
      for (int i = r->iov_first; i < r->iov_count && n < kMaxSendIov && bytes < kBatchBytes; ++i) {
        send_iov_[n] = r->iov[i];
        send_iov_[n].iov_len = std::min(send_iov_[n].iov_len, kBatchBytes - bytes);
        bytes += send_iov_[n++].iov_len;
      }
    }
    if (tls_->write(send_iov_, n) != 0) {
      on_sent(-EIO);  // the session cannot go on: as if the client were gone
      return;
    }
    replies_sent(bytes);  // encrypted: the requests and their buffers are done with
  }
  const std::string_view out = tls_->output();
  if (out.empty()) return;
  send_iov_[0] = {const_cast<char*>(out.data()), out.size()};
  send_msg_.msg_iov = send_iov_;
  send_msg_.msg_iovlen = 1;
  send_prepared(with_others);
}

}  // namespace shareblk::target
