// The reply half of a connection's transmission phase: each reply encoded as the session
// agreed (simple or structured replies, proto.md "Simple reply message" and "Structured reply
// chunk message"), queued in completion order, and sent in batches of as few sendmsg calls
// as the socket takes.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "target/worker.h"

namespace shareblk::target {

using namespace nbd;  // NOLINT(google-build-using-namespace): the wire vocabulary

namespace {

// errno to the values the wire allows (proto.md "Error values").
uint32_t wire_error(int err) {
  switch (err) {
    case EPERM:
    case EROFS:
    case EACCES:
    case EBADF:
      return kEperm;
    case ENOMEM:
      return kEnomem;
    case EINVAL:
      return kEinval;
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return kEnospc;
    case EOVERFLOW:
      return kEoverflow;
    case ENOTSUP:
      return kEnotsup;
    case ESHUTDOWN:
      return kEshutdown;
    default:
      return kEio;
  }
}

}  // namespace

void Connection::encode_reply(Request* r, int err) {
  uint8_t* p = r->reply;
  int n = 0;
  size_t total = 0;
  auto add = [&](void* base, size_t length) {
    r->iov[n++] = iovec{base, length};
    total += length;
  };
  const uint32_t wire = err ? wire_error(err) : 0;

  if (!session_.structured_replies) {
    encode_simple_reply(p, wire, r->cookie);
    add(p, kSimpleReplySize);
    if (wire == 0 && r->type == kCmdRead && r->length > 0) add(r->buf, r->length);
  } else if (wire != 0) {
    // An error chunk says what went wrong; for reads, also where (ERROR_OFFSET). That offset
    // MUST lie within the request (proto.md "Structured reply types"): a read that names no
    // byte, or whose end does not fit in 64 bits, has none to give and gets a plain ERROR.
    const char* text = strerrordesc_np(err);
    const uint16_t text_len =
        static_cast<uint16_t>(std::min<size_t>(text ? std::strlen(text) : 0, 200));
    const bool with_offset = r->type == kCmdRead && r->length > 0 &&
                             r->offset <= std::numeric_limits<uint64_t>::max() - r->length;
    const uint32_t length = 4 + 2 + text_len + (with_offset ? 8 : 0);
    encode_chunk_header(p, kReplyFlagDone, with_offset ? kReplyErrorOffset : kReplyError, r->cookie,
                        length);
    put32(p + kChunkHeaderSize, wire);
    put16(p + kChunkHeaderSize + 4, text_len);
    // The wire's strings are length-prefixed, never NUL-terminated (proto.md "Conventions").
    // NOLINTNEXTLINE(bugprone-not-null-terminated-result)
    if (text_len) std::memcpy(p + kChunkHeaderSize + 6, text, text_len);
    if (with_offset) put64(p + kChunkHeaderSize + 6 + text_len, r->offset);
    add(p, kChunkHeaderSize + length);
  } else if (r->type == kCmdRead && r->length > 0) {
    // Data and hole chunks, unless the client forbade fragmenting (DF) or nothing can be a
    // hole. Holes are looked up after the read; a write racing the read may go either way,
    // as it may for the read itself. Not for volumes in memory: the bytes are already read
    // from RAM, and tmpfs's SEEK_DATA walks fallocated pages one by one to the next data.
    extents_.clear();
    const backend::Volume& volume = *handle_.volume();
    if (!(r->nbd_flags & kCmdFlagDf) && volume.may_have_holes() && !volume.in_memory()) {
      handle_.extents(r->offset, r->length, Request::kMaxChunks - 1, extents_);
    }
    uint64_t covered = 0;
    for (const backend::Extent& e : extents_) covered += e.length;
    if (covered < r->length) extents_.push_back({r->length - covered, false});
    covered = 0;
    for (size_t i = 0; i < extents_.size(); ++i) {
      const backend::Extent& e = extents_[i];
      const uint16_t flags = i + 1 == extents_.size() ? kReplyFlagDone : 0;
      if (e.hole) {
        encode_chunk_header(p, flags, kReplyOffsetHole, r->cookie, 12);
        put64(p + kChunkHeaderSize, r->offset + covered);
        put32(p + kChunkHeaderSize + 8, static_cast<uint32_t>(e.length));
        add(p, kChunkHeaderSize + 12);
        p += kChunkHeaderSize + 12;
      } else {
        encode_chunk_header(p, flags, kReplyOffsetData, r->cookie,
                            static_cast<uint32_t>(8 + e.length));
        put64(p + kChunkHeaderSize, r->offset + covered);
        add(p, kChunkHeaderSize + 8);
        add(r->buf + covered, e.length);
        p += kChunkHeaderSize + 8;
      }
      covered += e.length;
    }
  } else if (r->type == kCmdBlockStatus) {
    const uint32_t count = static_cast<uint32_t>(extents_.size());
    encode_chunk_header(p, kReplyFlagDone, kReplyBlockStatus, r->cookie, 4 + 8 * count);
    put32(p + kChunkHeaderSize, kBaseAllocationId);
    uint8_t* d = p + kChunkHeaderSize + 4;
    for (const backend::Extent& e : extents_) {
      put32(d, static_cast<uint32_t>(e.length));
      put32(d + 4, e.hole ? (kStateHole | kStateZero) : 0);
      d += 8;
    }
    add(p, kChunkHeaderSize + 4 + 8 * count);
  } else {
    encode_chunk_header(p, kReplyFlagDone, kReplyNone, r->cookie, 0);
    add(p, kChunkHeaderSize);
  }
  r->iov_first = 0;
  r->iov_count = n;
  r->reply_left = total;
}

void Connection::queue_reply(Request* r) {
  r->next = nullptr;
  if (sendq_tail_ != nullptr) {
    sendq_tail_->next = r;
  } else {
    sendq_head_ = r;
  }
  sendq_tail_ = r;
  send_more();
}

void Connection::send_more() {
  if (send_ != SendState::Idle || socket_ == SocketState::Broken) return;
  if (sendq_head_ == nullptr && !(tls_ && tls_->has_output())) return;
  // Replies wait for the end of the worker's batch of completions, then go out in one
  // sendmsg straight from the thread; only a full socket makes it an io_uring operation.
  send_ = SendState::Scheduled;
  worker_.schedule_flush(this);
}

void Connection::flush(bool with_others) {
  send_ = SendState::Idle;  // never InFlight here: a send in flight schedules none
  if (tls_) {
    tls_flush(with_others);
    return;
  }
  if (sendq_head_ == nullptr || socket_ == SocketState::Broken) return;
  int n = 0;
  for (Request* r = sendq_head_; r != nullptr; r = r->next) {
    const int count = r->iov_count - r->iov_first;
    if (n + count > kMaxSendIov) break;
    std::copy(r->iov + r->iov_first, r->iov + r->iov_count, send_iov_ + n);
    n += count;
  }
  send_msg_.msg_iov = send_iov_;
  send_msg_.msg_iovlen = static_cast<size_t>(n);
  send_prepared(with_others);
}

void Connection::send_prepared(bool with_others) {
  if (!with_others) {
    const ssize_t sent = ::sendmsg(fd_, &send_msg_, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      on_sent(sent < 0 ? -errno : static_cast<int>(sent));  // may delete this
      return;
    }
  }
  worker_.ring().sendmsg(fd_, &send_msg_, &send_done_);  // sent when there is room
  send_ = SendState::InFlight;
  send_posted_ = std::chrono::steady_clock::now();
  worker_.send_queued();
}

void Connection::on_sent(int res) {
  if (send_ == SendState::InFlight) {  // else sent at once, from send_prepared()
    send_ = SendState::Idle;
    worker_.send_ended();
  }
  if (res == -EINTR || res == -EAGAIN) {
    send_more();
    return;
  }
  // The client is gone: drop every reply still queued.
  if (res <= 0 || socket_ == SocketState::Broken) {
    if (socket_ != SocketState::Broken) {
      socket_ = SocketState::Broken;
      set_receive(ReceiveState::Stopped);
      ::shutdown(fd_, SHUT_RDWR);  // also ends a pending receive
    }
    drop_replies();
    maybe_close();
    return;
  }
  if (tls_) {
    tls_->sent(static_cast<size_t>(res));
  } else {
    replies_sent(static_cast<size_t>(res));
  }
  parse();
  post_recv();
  send_more();
  maybe_close();
}

void Connection::replies_sent(size_t n) {
  size_t left = n;
  while (left > 0 && sendq_head_ != nullptr) {
    Request* r = sendq_head_;
    if (left >= r->reply_left) {
      left -= r->reply_left;
      sendq_head_ = r->next;
      if (sendq_head_ == nullptr) sendq_tail_ = nullptr;
      release(r);
      continue;
    }
    // A short send: the rest of this reply goes out next.
    r->reply_left -= left;
    while (left > 0) {
      iovec& v = r->iov[r->iov_first];
      if (left >= v.iov_len) {
        left -= v.iov_len;
        ++r->iov_first;
      } else {
        v.iov_base = static_cast<char*>(v.iov_base) + left;
        v.iov_len -= left;
        left = 0;
      }
    }
  }
}

}  // namespace shareblk::target
