// The transmission phase of one connection (proto.md "Transmission phase"): requests parsed
// from a receive buffer, checked, held for QoS and run through the backend on the worker's
// ring. Their replies: connection_reply.cc; TLS: connection_tls.cc.
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "target/rate_limited_log.h"
#include "target/sockets.h"
#include "target/worker.h"

namespace shareblk::target {

using namespace nbd;  // NOLINT(google-build-using-namespace): the wire vocabulary

namespace {

// Which command flags each command accepts; any other gets EINVAL (proto.md "Error values").
// FUA is valid on every command once NBD_FLAG_SEND_FUA is advertised (proto.md "Command
// flags"); where a command writes nothing there is nothing to make durable, and it is ignored.
uint16_t allowed_flags(uint16_t type, const Session& session) {
  const uint16_t fua = (session.transmission_flags & kFlagSendFua) ? kCmdFlagFua : 0;
  switch (type) {
    case kCmdRead:
      return fua | (session.structured_replies ? kCmdFlagDf : 0);
    case kCmdWrite:
    case kCmdFlush:
    case kCmdTrim:
    case kCmdCache:
      return fua;
    case kCmdWriteZeroes:
      return fua | kCmdFlagNoHole | kCmdFlagFastZero;
    case kCmdBlockStatus:
      return fua | kCmdFlagReqOne;
    default:
      return 0;
  }
}

// The backend operation that carries out an NBD command on the ring; nullopt for the others.
std::optional<backend::Op> op_of(uint16_t type) {
  switch (type) {
    case kCmdRead:
      return backend::Op::Read;
    case kCmdWrite:
      return backend::Op::Write;
    case kCmdFlush:
      return backend::Op::Flush;
    case kCmdTrim:
      return backend::Op::Trim;
    case kCmdWriteZeroes:
      return backend::Op::WriteZeroes;
    case kCmdCache:
      return backend::Op::Cache;
    default:
      return std::nullopt;
  }
}

// What a command counts as (IoStats); kKinds for a command that is none of them.
IoStats::Kind kind_of(uint16_t type) {
  switch (type) {
    case kCmdRead:
      return IoStats::Read;
    case kCmdWrite:
      return IoStats::Write;
    case kCmdTrim:
      return IoStats::Trim;
    case kCmdWriteZeroes:
      return IoStats::WriteZeroes;
    case kCmdFlush:
      return IoStats::Flush;
    case kCmdBlockStatus:
      return IoStats::BlockStatus;
    case kCmdCache:
      return IoStats::Cache;
    default:
      return IoStats::kKinds;
  }
}

// What a command counts as in QoS limits (docs/qos.md): reads and writes with their bytes,
// trims and write-zeroes as writes of no bytes; the rest are not limited.
struct QosCost {
  QosLimiter::Dir dir;
  uint64_t bytes;
};
QosCost qos_cost(uint16_t type, uint64_t length) {
  switch (type) {
    case kCmdRead:
      return {QosLimiter::Dir::Read, length};
    case kCmdWrite:
      return {QosLimiter::Dir::Write, length};
    case kCmdTrim:
    case kCmdWriteZeroes:
      return {QosLimiter::Dir::Write, 0};
    default:
      return {QosLimiter::Dir::None, 0};
  }
}

}  // namespace

void Request::done(int err) {
  conn->storage_done(this, err);
}

void Connection::storage_done(Request* r, int err) {
  --in_storage_;
  if (err == backend::kPaused && backend::is_change(r->op)) {
    if (!winding_down_) {
      hold_paused(r);
      return;
    }
    err = ESHUTDOWN;  // it did not run, and the pause may outlast the stop
  }
  finish_request(r, err);
}

Connection::Connection(Worker& worker, int fd, Session session, std::unique_ptr<TlsConnection> tls)
    : worker_(worker),
      fd_(fd),
      session_(std::move(session)),
      handle_(session_.exp.volume, session_.exp.mode, session_.exp.write_access),
      counters_(worker.counters_for(session_.exp.group)),
      qos_(session_.exp.qos ? *session_.exp.qos : QosLimiter::unlimited()),
      rbuf_(new char[kRecvBufferSize]),
      tcp_(is_tcp(fd)),
      tls_(std::move(tls)) {
  recv_done_.conn = this;
  send_done_.conn = this;
  cipher_done_.conn = this;
  if (tls_) tls_->begin_transmission();
  // Room for the most extents a reply can carry, taken once: how many there are depends on
  // the volume's holes, and a vector grown on the I/O path would allocate there.
  extents_.reserve(std::max(Request::kMaxExtents, Request::kMaxChunks) + 1);
}

Connection::~Connection() {
  if (send_ == SendState::Scheduled) worker_.cancel_flush(this);
  if (recv_ == RecvPending::TlsScheduled) worker_.cancel_tls_read(this);
  if (socket_ != SocketState::Broken) say_goodbye();
  if (waiting_for_budget_) worker_.cancel_wait_for_budget(this);
  if (payload_watched_) worker_.payload_ended();
  if (qos_timer_) worker_.cancel_qos_wait(*qos_timer_);
  ::close(fd_);
}

void Connection::start() {
  post_recv();
}

void Connection::drain() {
  set_receive(ReceiveState::Stopped);
  // Requests waiting for their QoS turn end here, never run: that turn may be minutes away,
  // and nobody is to wait for it, neither this close nor the others sharing the limits.
  qos_release(/*answer=*/false);
  ::shutdown(fd_, SHUT_RD);  // completes a pending receive with end-of-file
  maybe_close();
}

void Connection::abort() {
  if (socket_ != SocketState::Broken) say_goodbye();
  set_receive(ReceiveState::Stopped);
  socket_ = SocketState::Broken;
  drop_replies();
  qos_release(/*answer=*/false);
  ::shutdown(fd_, SHUT_RDWR);
  maybe_close();
}

void Connection::wind_down() {
  {
    Hold hold(*this);  // the replies to the refused requests may be all it waited for
    winding_down_ = true;
    qos_release(/*answer=*/true);
  }
  maybe_close();
}

void Connection::maybe_stop_reading() {
  if (!winding_down_ || receive_ != ReceiveState::Header || in_storage_ > 0) return;
  set_receive(ReceiveState::Stopped);
  ::shutdown(fd_, SHUT_RD);  // completes a pending receive with end-of-file
}

void Connection::drop_replies() {
  // The kernel may still read their buffers; on_sent comes back.
  if (send_ == SendState::InFlight) return;
  while (sendq_head_ != nullptr) {
    Request* r = sendq_head_;
    sendq_head_ = r->next;
    release(r);
  }
  sendq_tail_ = nullptr;
}

void Connection::post_recv() {
  track_payload();  // every path that parses comes here after it
  if (recv_ != RecvPending::None) return;
  if (receive_ == ReceiveState::Stopped) {
    drop_partial_request();
    return;
  }
  if (receive_ == ReceiveState::Payload) {
    recv_payload();
    return;
  }
  // Back-pressure: a client with too much in flight waits for replies before we read more.
  // Not while skipping a payload (Discard), which takes no memory and whose request counts in
  // flight.
  if (receive_ == ReceiveState::Header && must_wait()) return;
  if (rend_ - rpos_ >= kRequestSize) return;
  if (rpos_ > 0) {
    std::memmove(rbuf_.get(), rbuf_.get() + rpos_, rend_ - rpos_);
    rend_ -= rpos_;
    rpos_ = 0;
  }
  if (wake_at_ != 1) wake_reader_at(fd_, wake_at_ = 1);  // a header may be all that comes
  recv_into(rbuf_.get() + rend_, kRecvBufferSize - rend_);
}

// The rest of a WRITE's payload goes straight to its buffer. Over TCP a large one is taken
// in one receive once it is all here (SO_RCVLOWAT): woken at every segment, the worker took
// 1 MiB in about five receives, and the client, which delivers each segment, paid for waking
// it (bench/PROFILE.md, "Page-cache 1 MiB writes over TCP"). Unix sockets wake their reader
// at every message whatever the mark, and a TLS record is decrypted as it comes.
void Connection::recv_payload() {
  char* into = payload_for_->buf + payload_got_;
  const size_t left = payload_for_->length - payload_got_;
  if (!tcp_ || tls_ || left < kRecvBufferSize) {
    recv_into(into, left);
    return;
  }
  if (static_cast<size_t>(wake_at_) != left) wake_reader_at(fd_, wake_at_ = static_cast<int>(left));
  recv_ = RecvPending::Posted;
  worker_.ring().recv(fd_, into, left, &recv_done_, /*once_readable=*/true);
}

void Connection::recv_into(char* into, size_t length) {
  if (!tls_) {
    recv_ = RecvPending::Posted;
    worker_.ring().recv(fd_, into, length, &recv_done_);
    return;
  }
  tls_into_ = into;
  tls_room_ = length;
  // Not from here: the caller may be mid-reply.
  if (socket_ == SocketState::TlsFailing || tls_->readable()) {
    recv_ = RecvPending::TlsScheduled;
    worker_.schedule_tls_read(this);
    return;
  }
  post_cipher_recv();
}

void Connection::on_recv(int res) {
  recv_ = RecvPending::None;
  unread_seen_ = 0;
  if (res == -EINTR || res == -EAGAIN) {
    post_recv();
    return;
  }
  // End of file, a reset, a host gone silent (--peer-timeout-ms), or our own drain().
  if (res <= 0) {
    if (res < 0 && receive_ != ReceiveState::Stopped) {  // not Broken either
      client_log().warn_line(
          "lost", fmt::format("nbd: lost a client of {}: {}", group(), std::strerror(-res)));
    }
    set_receive(ReceiveState::Stopped);
    drop_partial_request();
    qos_release(/*answer=*/false);  // the client is gone: nobody takes their replies
    maybe_close();
    return;
  }
  {
    Hold hold(*this);
    // One clock read per receive, not per request: the requests it holds arrived together.
    if (kCountRequests || payload_watched_) received_at_ = std::chrono::steady_clock::now();
    if (payload_watched_) payload_progress_ = received_at_;
    if (payload_for_ != nullptr) {  // Payload, or Stopped during it
      payload_got_ += static_cast<uint32_t>(res);
      if (payload_got_ == payload_for_->length) {
        Request* r = std::exchange(payload_for_, nullptr);
        if (receive_ == ReceiveState::Payload) set_receive(ReceiveState::Header);
        dispatch(r);
      }
    } else {
      rend_ += static_cast<size_t>(res);
    }
    parse();
    post_recv();
  }
  maybe_close();
}

// A request whose payload will not arrive in full (the client vanished, or we stopped reading)
// is dropped unanswered, and nothing is written.
void Connection::drop_partial_request() {
  Request* r = payload_for_ != nullptr ? payload_for_ : refused_;
  payload_for_ = nullptr;
  refused_ = nullptr;
  discard_left_ = 0;
  track_payload();
  if (r != nullptr) release(r);
}

// A payload is awaited from when its header is parsed until its last byte is; the worker cuts
// off a connection whose payload stops arriving (ServerOptions::payload_timeout).
void Connection::track_payload() {
  const bool awaiting = payload_for_ != nullptr || discard_left_ > 0;
  if (awaiting == payload_watched_) return;
  payload_watched_ = awaiting;
  if (awaiting) {
    payload_progress_ = std::chrono::steady_clock::now();
    worker_.payload_awaited();
  } else {
    worker_.payload_ended();
  }
}

bool Connection::payload_stalled_since(std::chrono::steady_clock::time_point since) {
  if (!payload_watched_ || socket_ == SocketState::Broken || payload_progress_ >= since) {
    return false;
  }
  if (wake_at_ == 1) return true;
  // Under a low-water mark bytes can have come without waking us: more of them is progress.
  const int unread = unread_bytes(fd_);
  if (unread <= unread_seen_) return true;
  unread_seen_ = unread;
  payload_progress_ = std::chrono::steady_clock::now();
  return false;
}

bool Connection::must_wait() {
  if (inflight_ >= kMaxInflight || inflight_bytes_ >= kMaxInflightBytes) return true;  // on us
  if (!worker_.payload_budget_spent()) return false;
  if (!waiting_for_budget_) {  // on the others: the worker tells us when there is room
    waiting_for_budget_ = true;
    worker_.wait_for_budget(this);
  }
  return true;
}

void Connection::resume() {
  waiting_for_budget_ = false;
  {
    Hold hold(*this);
    parse();
    post_recv();
  }
  maybe_close();
}

void Connection::parse() {
  Hold hold(*this);
  for (;;) {
    if (receive_ == ReceiveState::Discard) {
      size_t n = std::min<uint64_t>(discard_left_, rend_ - rpos_);
      rpos_ += n;
      discard_left_ -= n;
      if (discard_left_ > 0) break;
      set_receive(ReceiveState::Header);
      finish_request(std::exchange(refused_, nullptr), refused_err_);
      continue;
    }
    if (receive_ != ReceiveState::Header) break;  // Payload: on_recv() takes it; Stopped
    if (must_wait()) break;
    if (rend_ - rpos_ < kRequestSize) break;
    nbd::Request h = decode_request(reinterpret_cast<const uint8_t*>(rbuf_.get() + rpos_));
    rpos_ += kRequestSize;
    if (!begin_request(h)) break;
  }
}

// Starts one request whose header was just parsed. False ends parsing (DISC, bad magic).
bool Connection::begin_request(const nbd::Request& h) {
  if (h.magic != kRequestMagic) {
    // Nothing after a bad header can be trusted: the spec's only answer is to disconnect.
    // Named by its group (the attachment id): an attachment's export name is a credential,
    // and no part of it goes into a log.
    client_log().warn_line(
        "bad request magic",
        fmt::format("nbd: bad request magic {:#x} from a client of {}, disconnecting", h.magic,
                    group()));
    abort();
    return false;
  }
  if (h.type == kCmdDisc) {
    set_receive(ReceiveState::Stopped);  // requests in flight are still answered, then we close
    return false;
  }
  Request* r = worker_.get_request();
  r->conn = this;
  if constexpr (kCountRequests) r->received = received_at_;
  r->cookie = h.cookie;
  r->type = h.type;
  r->nbd_flags = h.flags;
  r->offset = h.offset;
  r->length = h.length;
  r->flags = 0;
  r->buf = nullptr;
  r->buf_index = -1;
  r->payload_size = 0;
  r->next = nullptr;
  // Requests are reused: one dropped while it held a QoS turn (qos_release) must not hand that
  // turn, and its wait, to the next request of any connection on this worker.
  r->qos_charged = false;
  // Over TCP the client, not this worker, is the slower side of a large write (ring.cc).
  r->copy_writes_beside = !tcp_;
  ++inflight_;

  int err = 0;
  const std::optional<backend::Op> op = op_of(h.type);
  if (winding_down_) {
    err = ESHUTDOWN;  // proto.md: the server is shutting down; a WRITE's payload is skipped
  } else if (h.type == kCmdBlockStatus) {
    if (!session_.base_allocation) err = EINVAL;  // no metadata context was negotiated
  } else if (!op) {
    err = EINVAL;  // unknown command
  }
  if (!err && (h.flags & ~allowed_flags(h.type, session_))) err = EINVAL;
  const bool has_payload = h.type == kCmdWrite;
  const bool needs_buffer = has_payload || h.type == kCmdRead;
  if (!err && needs_buffer && h.length > kMaxPayload) err = EOVERFLOW;
  if (!err && needs_buffer && h.length > 0) {
    const BufferPool::Buffer b = worker_.pool().get(h.length);
    r->buf = b.data;
    r->buf_index = b.index;
    if (r->buf == nullptr) {
      err = ENOMEM;
    } else {
      r->payload_size = h.length;
      inflight_bytes_ += h.length;
      worker_.payload_taken(h.length);
    }
  }
  // A change from a read-only attachment gets EPERM before any other error (bad flags, too
  // large): what the client must learn is that it may not write here. The backend's admission
  // rule decides; a request with no other error meets it on the I/O path, so only a request
  // refused here is asked.
  if (err != 0 && err != ESHUTDOWN && op && handle_.admit(*op, h.offset, h.length) == EPERM) {
    err = EPERM;  // only changes get EPERM from admission
  }
  if (err) {
    if (has_payload && h.length > 0) {
      refused_ = r;
      refused_err_ = err;
      discard_left_ = h.length;
      set_receive(ReceiveState::Discard);
    } else {
      finish_request(r, err);
    }
    return true;
  }
  if (has_payload && h.length > 0) {  // a zero-length write has no buffer to copy into
    const uint32_t have = static_cast<uint32_t>(std::min<size_t>(h.length, rend_ - rpos_));
    std::memcpy(r->buf, rbuf_.get() + rpos_, have);
    rpos_ += have;
    if (have < h.length) {
      payload_for_ = r;
      payload_got_ = have;
      set_receive(ReceiveState::Payload);
      return true;
    }
  }
  dispatch(r);
  return true;
}

void Connection::dispatch(Request* r) {
  if (winding_down_) [[unlikely]] {  // a WRITE received in full after the stop: no QoS wait
    run(r);
    return;
  }
  // Without a limit on the attachment or its volume this one test is all QoS costs. While
  // requests wait, later ones queue behind them, whatever they are: a connection's requests
  // start in the order they came.
  if ((kQos && qos_.engaged()) || qos_head_ != nullptr) [[unlikely]] {
    qos_hold(r);
    return;
  }
  run(r);
}

void Connection::hold_paused(Request* r) {
  r->qos_charged = true;
  r->qos_turn = {};
  r->next = qos_head_;
  qos_head_ = r;
  if (qos_tail_ == nullptr) qos_tail_ = r;
  if (qos_timer_) worker_.cancel_qos_wait(*qos_timer_);
  qos_timer_ =
      worker_.qos_wait(this, std::chrono::steady_clock::now() + std::chrono::milliseconds(1));
}

void Connection::qos_hold(Request* r) {
  r->next = nullptr;
  if (qos_tail_ != nullptr) {
    qos_tail_->next = r;  // the timer is set for the head already
    qos_tail_ = r;
    return;
  }
  qos_head_ = qos_tail_ = r;
  qos_start_ready();
}

void Connection::qos_resume() {
  qos_timer_.reset();
  {
    Hold hold(*this);
    qos_start_ready();
  }
  maybe_close();
}

void Connection::qos_start_ready() {
  if (socket_ == SocketState::Broken) {
    qos_release(/*answer=*/false);
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  while (qos_head_ != nullptr) {
    Request* r = qos_head_;
    if (!r->qos_charged && qos_.engaged()) {
      // Only the head takes its turn: a connection holds one at a time, so connections
      // sharing a volume's limit alternate.
      const QosCost cost = qos_cost(r->type, r->length);
      r->qos_generation = qos_.generation();
      r->qos_turn = now + qos_.admit(cost.dir, cost.bytes, now);
      r->qos_charged = true;
    }
    if (r->qos_charged && r->qos_turn > now && qos_.engaged() &&
        r->qos_generation == qos_.generation()) {
      // Looked at again within 100 ms at most, so that a raised or removed limit takes
      // effect then even if its turn is far.
      const auto when = std::min(r->qos_turn, now + std::chrono::milliseconds(100));
      if (qos_timer_) worker_.cancel_qos_wait(*qos_timer_);
      qos_timer_ = worker_.qos_wait(this, when);
      return;
    }
    qos_head_ = r->next;
    if (qos_head_ == nullptr) qos_tail_ = nullptr;
    r->qos_charged = false;
    run(r);
    if (qos_head_ == r) return;            // held by a pause again; its timer is set
    if (socket_ == SocketState::Broken) {  // its reply failed to go: the rest are dropped
      qos_release(/*answer=*/false);
      return;
    }
  }
}

void Connection::qos_release(bool answer) {
  if (qos_timer_) {
    worker_.cancel_qos_wait(*qos_timer_);
    qos_timer_.reset();
  }
  while (qos_head_ != nullptr) {
    Request* r = qos_head_;
    qos_head_ = r->next;
    // What it took from the buckets goes back: the requests that ask next do not wait for
    // the turn of one that will never run.
    if (r->qos_charged) {
      const QosCost cost = qos_cost(r->type, r->length);
      qos_.refund(cost.dir, cost.bytes);
    }
    if (answer) {
      finish_request(r, ESHUTDOWN);
    } else {
      release(r);
    }
  }
  qos_tail_ = nullptr;
}

void Connection::run(Request* r) {
  if (r->type == kCmdBlockStatus) {
    // SEEK_DATA/SEEK_HOLE answer from file system metadata: no reason to leave the thread.
    int err =
        r->length == 0
            ? EINVAL
            : handle_.extents(r->offset, r->length,
                              (r->nbd_flags & kCmdFlagReqOne) ? 1 : Request::kMaxExtents, extents_);
    finish_request(r, err);
    return;
  }
  const std::optional<backend::Op> op = op_of(r->type);
  if (!op) {
    finish_request(r, EINVAL);
    return;
  }
  r->op = *op;
  if (r->nbd_flags & kCmdFlagFua) r->flags |= backend::kFua;
  if (r->nbd_flags & kCmdFlagNoHole) r->flags |= backend::kNoHole;
  if (r->nbd_flags & kCmdFlagFastZero) r->flags |= backend::kFastZero;
  ++in_storage_;  // before: it may come back inside submit()
  worker_.ring().submit(handle_, r);
}

void Connection::finish_request(Request* r, int err) {
  if constexpr (kCountRequests) {
    counters_.record(kind_of(r->type), r->length, err,
                     std::chrono::steady_clock::now() - r->received);
  }
  if (socket_ == SocketState::Broken) {
    release(r);
  } else {
    encode_reply(r, err);
    queue_reply(r);
  }
  maybe_close();
}

void Connection::release(Request* r) {
  if (r->payload_size > 0) {
    worker_.pool().put({r->buf, r->buf_index}, r->payload_size);
    inflight_bytes_ -= r->payload_size;
    worker_.payload_returned(r->payload_size);
  }
  --inflight_;
  worker_.put_request(r);
  post_recv();
}

void Connection::maybe_close() {
  maybe_stop_reading();
  if (holds_ > 0 || receive_ != ReceiveState::Stopped || recv_ != RecvPending::None ||
      send_ == SendState::InFlight || inflight_ > 0) {
    return;
  }
  // Records of the last replies still to go out (a short send); they go before the close.
  if (tls_ && socket_ != SocketState::Broken && tls_->has_output()) return;
  worker_.connection_finished(this);  // deletes this
}

}  // namespace shareblk::target
