// Internal to target/: the io_uring worker threads and the connections they serve.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <array>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backend/backend.h"
#include "target/handshake.h"
#include "target/io_stats.h"
#include "target/nbd_proto.h"
#include "target/qos.h"
#include "target/tls.h"

namespace shareblk::target {

// Payload buffers by power-of-two size class, 4 KiB aligned for O_DIRECT, recycled so that the
// steady state allocates nothing. Buffers up to kRegisterMax are registered with the worker's
// ring as they are made (see backend::Ring::register_buffer). Owned by one worker thread.
class BufferPool {
 public:
  static constexpr uint32_t kMinSize = 4096;
  static constexpr int kClasses = 14;  // 4 KiB .. 32 MiB
  static_assert((kMinSize << (kClasses - 1)) == nbd::kMaxPayload);
  static constexpr uint32_t kRegisterMax = 1u << 20;

  struct Buffer {
    char* data = nullptr;
    int index = -1;  // registered buffer index, or -1
  };

  BufferPool() = default;
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // Registers the buffers made from now on with `ring`; nullptr before the ring goes away.
  void use_ring(backend::Ring* ring);

  // A buffer of at least `size` bytes (size <= kMaxPayload); data is nullptr when out of memory.
  Buffer get(uint32_t size);
  void put(Buffer buf, uint32_t size);

 private:
  static int size_class(uint32_t size);
  void release(Buffer buf);
  backend::Ring* ring_ = nullptr;
  std::array<std::vector<Buffer>, kClasses> free_;
};

class Worker;
class Connection;

// Connections whose first QoS-held request may go at that time (Worker::qos_wait).
using QosTimers = std::multimap<std::chrono::steady_clock::time_point, Connection*>;

// Whether requests are counted (target/CMakeLists.txt, SHAREBLK_IO_STATS): off only to
// measure what counting costs (bench/io-stats).
#ifndef SHAREBLK_IO_STATS
#define SHAREBLK_IO_STATS 1
#endif
inline constexpr bool kCountRequests = SHAREBLK_IO_STATS != 0;
// Whether QoS limits are enforced (target/CMakeLists.txt, SHAREBLK_QOS): off only to measure
// what the test for a limit costs when there is none (bench/qos-cost).
#ifndef SHAREBLK_QOS
#define SHAREBLK_QOS 1
#endif
inline constexpr bool kQos = SHAREBLK_QOS != 0;

// A count written by one thread and read by any: a relaxed load and store, never a
// read-modify-write, so counting takes no locked instruction and TSan sees no race.
class OwnedCounter {
 public:
  void add(uint64_t n) {
    value_.store(value_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  uint64_t get() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// One group's request counts on one worker, written only by that worker's thread
// (IoStats says what each means).
struct GroupCounters {
  struct Op {
    OwnedCounter requests, bytes, errors, time_ns;
    std::array<OwnedCounter, IoStats::kBuckets> latency;
  };
  std::array<Op, IoStats::kKinds> ops;
  OwnedCounter refused_writes;
  // Linux's errno values are below 134; the last slot counts any other.
  static constexpr int kErrnoSlots = 134;
  std::array<OwnedCounter, kErrnoSlots + 1> by_errno;

  // One answered request; `kind` kKinds when the command has none.
  void record(IoStats::Kind kind, uint64_t bytes, int err, std::chrono::nanoseconds took);
  void add_to(IoStats& into) const;
};

// One NBD request from header to reply.
struct Request final : backend::IoRequest {
  // A structured reply is at most this many chunks (reads with holes), and a block status
  // reply at most this many extents.
  static constexpr size_t kMaxChunks = 16;
  static constexpr size_t kMaxExtents = 128;
  static constexpr size_t kReplyBytes = 64 + kMaxChunks * 32 + kMaxExtents * 8;
  static constexpr size_t kMaxIov = 2 * kMaxChunks + 1;

  Connection* conn = nullptr;
  std::chrono::steady_clock::time_point received;  // its header came in (latency)
  uint64_t cookie = 0;
  uint16_t type = 0;
  uint16_t nbd_flags = 0;
  uint32_t payload_size = 0;  // bytes of `buf` (pool size), 0 when none
  // The connection's QoS queue while the request waits there, then its reply queue.
  Request* next = nullptr;
  // QoS took its cost (it is not charged again): it starts at `qos_turn`, or at once if the
  // limits changed since (`qos_generation`). Also set for a request that met a paused write
  // access (a snapshot) and waits at the head of the QoS queue with its turn past.
  bool qos_charged = false;
  uint64_t qos_generation = 0;
  std::chrono::steady_clock::time_point qos_turn;

  // The encoded reply: headers in `reply`, data straight from `buf`.
  uint8_t reply[kReplyBytes];
  iovec iov[kMaxIov];
  int iov_first = 0;  // iovecs before this one are sent
  int iov_count = 0;
  size_t reply_left = 0;

  void done(int err) override;
};

// The transmission phase of one client connection. Lives on one worker; every member is
// touched only by that worker's thread.
class Connection {
 public:
  // `tls`: the connection's TLS session after its handshake, or null for plaintext.
  Connection(Worker& worker, int fd, Session session, std::unique_ptr<TlsConnection> tls);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void start();
  // Stop reading; requests already received are answered, then the connection closes. Those
  // still waiting for their QoS turn are dropped unanswered, never run (qos_release).
  void drain();
  // Cut the connection off now (requests in flight still complete inside the server).
  void abort();
  // The daemon stops (docs/operations.md, "Signals"): requests already started are carried
  // out and answered; those that have not (a QoS turn, a paused write) and any that come
  // meanwhile are answered ESHUTDOWN. Once none is left in storage, nothing more is read and
  // the connection closes after its last reply.
  void wind_down();
  // The client has taken none of its replies, or sent none of a payload it owes, since before
  // `since`.
  bool stalled_since(std::chrono::steady_clock::time_point since) {
    return send_stalled_since(since) || payload_stalled_since(since);
  }
  // A request that went to storage (run()) is back.
  void storage_done(Request* r, int err);

  const std::string& group() const { return session_.exp.group; }
  uint64_t serial() const { return session_.serial; }
  void finish_request(Request* r, int err);
  // `r` met a paused write access: it goes back to the head of the QoS queue, looked at again
  // every millisecond until the pause is over.
  void hold_paused(Request* r);
  void on_recv(int res);
  void on_sent(int res);
  // TLS: decrypts what has come into where post_recv() wanted it; the worker calls it for a
  // connection that had bytes to decrypt already (Worker::schedule_tls_read).
  void tls_read();
  // Sends the queued replies; called by the worker after a batch of completions. Alone in
  // the batch, with one sendmsg now; `with_others`, as an io_uring operation that the
  // worker's next io_uring_enter submits with the other connections' (see worker.cc).
  void flush(bool with_others);
  // Reads requests again after waiting for the worker's payload budget.
  void resume();
  // Starts the requests QoS held that may go now (the worker's timer for them expired).
  void qos_resume();
  // True when a send has waited for room in the socket since before `since`: the client has
  // taken none of its replies for that long.
  bool send_stalled_since(std::chrono::steady_clock::time_point since) const {
    return send_ == SendState::InFlight && socket_ != SocketState::Broken && send_posted_ < since;
  }
  // True when a request's payload has been awaited since before `since` without a byte of it
  // arriving: the client promised bytes it does not send.
  bool payload_stalled_since(std::chrono::steady_clock::time_point since);

 private:
  struct RecvCompletion final : backend::Completion {
    Connection* conn;
    void complete(int res) override { conn->on_recv(res); }
  };
  struct SendCompletion final : backend::Completion {
    Connection* conn;
    void complete(int res) override { conn->on_sent(res); }
  };
  struct CipherCompletion final : backend::Completion {
    Connection* conn;
    void complete(int res) override { conn->on_cipher(res); }
  };

  // What the receive side is doing (in the spirit of SPDK's nbd_io_state_t). set_receive() is
  // the only writer, called where the event that moves it is handled; each state's code is in
  // post_recv() (what to receive next), on_recv() (where the bytes go) and parse().
  //   Header   the request stream comes into rbuf_: headers, and the payloads that fit with
  //            them. No receive is posted while the client or the worker is over a limit
  //            (must_wait()): a reply's release() or the worker's resume() tries again.
  //   Payload  the rest of payload_for_'s payload comes straight into its buffer.
  //   Discard  refused_'s payload comes into rbuf_ and is skipped: the stream stays in step.
  //   Stopped  nothing more is read: end of file, NBD_CMD_DISC, a bad request, drain(),
  //            abort(), a failed socket, or wound down. A receive in flight still lands, and
  //            payload_for_ / refused_ keep the request it was for until it is back: a payload
  //            it completes still runs, drop_partial_request() drops one it leaves short.
  // Header -> Payload | Discard: begin_request(), a WRITE whose payload is not all in rbuf_.
  // Payload -> Header: on_recv(), the payload is complete. Discard -> Header: parse().
  // Any -> Stopped, which is final.
  enum class ReceiveState : uint8_t { Header, Payload, Discard, Stopped };
  void set_receive(ReceiveState next) {
    assert(next == ReceiveState::Stopped ||
           (receive_ != ReceiveState::Stopped &&
            (receive_ == ReceiveState::Header) != (next == ReceiveState::Header)));
    receive_ = next;
  }
  // The receive in flight. Apart from receive_: drain() stops reading while one is in flight,
  // and the connection lives until it is back.
  //   None          no receive is out; post_recv() may post one.
  //   Posted        one is out, on the ring (the request stream, or TLS ciphertext) or being
  //                 decrypted by tls_read(): on_recv() is still to come.
  //   TlsScheduled  Posted, as the worker's call of tls_read() once the batch of completions
  //                 is handled (Worker::schedule_tls_read; the destructor cancels it).
  // None -> Posted | TlsScheduled (recv_into()); TlsScheduled -> Posted (tls_read());
  // Posted -> None (on_recv()).
  enum class RecvPending : uint8_t { None, Posted, TlsScheduled };
  // How far the socket, and the TLS session on it, is gone. Broken comes with receive_
  // Stopped: a socket that cannot send has no use for requests.
  //   Open        the socket and session work.
  //   TlsFailing  a TLS record failed after bytes that are still delivered: they are the
  //               client's requests all the same, and the next read ends the stream.
  //   Broken      the socket failed or abort() cut it: nothing more is sent, replies are
  //               dropped. Final.
  // Open -> TlsFailing (tls_read()); Open | TlsFailing -> Broken (abort(), a failed send, a
  // failed record).
  enum class SocketState : uint8_t { Open, TlsFailing, Broken };
  // The replies' sending: one send at a time.
  //   Idle       nothing is on its way (replies may be queued for the next flush).
  //   Scheduled  the worker calls flush() once its batch of completions is handled
  //              (Worker::schedule_flush; the destructor cancels it).
  //   InFlight   a sendmsg waits on the ring for room in the socket: the kernel reads
  //              send_msg_ and the replies' buffers until on_sent().
  // Idle -> Scheduled (send_more()) -> Idle (flush()) -> InFlight (send_prepared(), a full
  // socket) -> Idle (on_sent()).
  enum class SendState : uint8_t { Idle, Scheduled, InFlight };

  void post_recv();
  // Receives the rest of payload_for_'s payload; on_recv() follows.
  void recv_payload();
  // Receives up to `length` bytes of the request stream into `into`; on_recv() follows.
  void recv_into(char* into, size_t length);
  void post_cipher_recv();
  void on_cipher(int res);
  // TLS: encrypts queued replies and sends what is encrypted.
  void tls_flush(bool with_others);
  // Sends send_msg_: at once with one sendmsg, or (`with_others`, or the socket is full) as
  // an io_uring operation; on_sent() follows either way.
  void send_prepared(bool with_others);
  // The first `n` bytes of the queued replies are out (or encrypted): their requests go.
  void replies_sent(size_t n);
  void drop_partial_request();
  // Tells the worker whether a payload is awaited now (for its payload deadline).
  void track_payload();
  void parse();
  bool begin_request(const nbd::Request& header);
  // A request ready to run: QoS lets it go now, or holds it in the connection's QoS queue.
  void dispatch(Request* r);
  void run(Request* r);
  // Appends `r` to the QoS queue, then starts the queue's requests that may go now, in
  // order, and sets the worker's timer for the first that may not.
  void qos_hold(Request* r);
  void qos_start_ready();
  // The requests held for their QoS turn never run, and what QoS took for them goes back to
  // the limiter (QosLimiter::refund): a closing connection's are released unanswered, a
  // winding-down one's are answered ESHUTDOWN (`answer`).
  void qos_release(bool answer);
  // Winding down: stops reading once no request is in storage or half received.
  void maybe_stop_reading();
  void encode_reply(Request* r, int err);
  void queue_reply(Request* r);
  void send_more();
  void release(Request* r);
  void drop_replies();
  void say_goodbye();
  void maybe_close();

  Worker& worker_;
  int fd_;
  Session session_;
  backend::Handle handle_;
  GroupCounters& counters_;  // its group's, on this worker
  // The attachment's limits (QosLimiter::unlimited() for an export without any). Requests it
  // holds wait here, in arrival order, until their tokens are there; nothing else waits.
  QosLimiter& qos_;
  Request* qos_head_ = nullptr;
  Request* qos_tail_ = nullptr;
  std::optional<QosTimers::iterator> qos_timer_;

  // Received bytes not yet parsed live in rbuf_[rpos_, rend_).
  static constexpr size_t kRecvBufferSize = 64 * 1024;
  std::unique_ptr<char[]> rbuf_;
  size_t rpos_ = 0;
  size_t rend_ = 0;
  std::chrono::steady_clock::time_point received_at_;  // when the last bytes came in
  Request* payload_for_ = nullptr;                     // a WRITE whose payload is still arriving
  uint32_t payload_got_ = 0;
  // A refused WRITE is answered once its payload has been read and dropped: a reply that
  // overtakes the request it answers makes clients (libnbd) drop the connection.
  Request* refused_ = nullptr;
  int refused_err_ = 0;
  uint64_t discard_left_ = 0;  // payload bytes of refused_ still to skip
  ReceiveState receive_ = ReceiveState::Header;
  RecvPending recv_ = RecvPending::None;
  SocketState socket_ = SocketState::Open;
  // The worker counts this connection among those awaiting a payload (payload_for_'s or
  // refused_'s; Worker::payload_awaited), and since when a byte of it last came. Not a
  // ReceiveState: the count follows the request, which outlives Payload when reading stops
  // mid-payload, and it is brought up to date once per handler (track_payload()), so that a
  // payload that ends and the next that begins in one receive cost the worker nothing.
  bool payload_watched_ = false;
  std::chrono::steady_clock::time_point payload_progress_;
  // TCP: the socket's SO_RCVLOWAT (recv_payload() says why), and how many bytes the stall
  // check last saw queued under it, unread (they count as progress).
  const bool tcp_;
  int wake_at_ = 1;
  int unread_seen_ = 0;

  RecvCompletion recv_done_;
  SendCompletion send_done_;
  // TLS: the worker's socket carries records, and the session makes the request stream of
  // them and the records of the replies. recv_into()'s target waits in tls_into_ while
  // ciphertext is received (cipher_done_) or the worker is asked to decrypt what is here.
  std::unique_ptr<TlsConnection> tls_;
  CipherCompletion cipher_done_;
  char* tls_into_ = nullptr;
  size_t tls_room_ = 0;
  // Handlers that go on using the connection after dispatching requests hold it open: a
  // request may complete inside dispatch (refused at admission, or an in-memory volume), and
  // its reply may be the last thing the connection waited for.
  int holds_ = 0;
  struct Hold {
    explicit Hold(Connection& c) : conn(c) { ++conn.holds_; }
    ~Hold() { --conn.holds_; }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    Connection& conn;
  };

  // Replies wait in a FIFO; one sendmsg at a time carries as many as fit.
  Request* sendq_head_ = nullptr;
  Request* sendq_tail_ = nullptr;
  SendState send_ = SendState::Idle;
  std::chrono::steady_clock::time_point send_posted_;  // when the pending send was queued
  // On the worker's list of connections to resume() once its payload budget has room. Not a
  // ReceiveState: the connection reads again on its own as soon as the budget has room (its
  // own replies freed some), and stays listed until the worker's resume() or the destructor.
  bool waiting_for_budget_ = false;
  static constexpr int kMaxSendIov = 256;
  iovec send_iov_[kMaxSendIov];
  msghdr send_msg_{};

  // Limits on what one client may have in flight: bounded memory per connection.
  static constexpr uint32_t kMaxInflight = 256;
  static constexpr uint64_t kMaxInflightBytes = 128ull << 20;
  uint32_t inflight_ = 0;
  uint64_t inflight_bytes_ = 0;
  uint32_t in_storage_ = 0;  // requests run() handed to the ring and not back yet
  // wind_down(): the daemon stops. Not a SocketState or ReceiveState: a connection winding
  // down reads on until its requests are out of storage, and can still break.
  bool winding_down_ = false;
  // True when this connection may not start another request now (its limits or its worker's).
  bool must_wait();

  std::vector<backend::Extent> extents_;  // scratch for block status and sparse reads
};

// Callbacks from workers to the server's registry of connections.
class ConnectionRegistry {
 public:
  virtual void connection_closed(const std::string& group, uint64_t serial) = 0;

 protected:
  ~ConnectionRegistry() = default;
};

// One thread, one ring, many connections.
class Worker {
 public:
  // `payload_budget`: payload bytes all of this worker's connections may hold at once.
  // `send_timeout` (ServerOptions::send_timeout): a connection whose client takes none of its
  // replies for this long is cut off (0 = never), so that a hung client cannot keep its
  // buffers, and with them the budget of the other connections here, for ever.
  // `payload_timeout` (ServerOptions::payload_timeout): likewise for a client that sends none
  // of a request's payload for this long (0 = never).
  Worker(ConnectionRegistry& registry, uint64_t payload_budget,
         std::chrono::milliseconds send_timeout,
         std::chrono::milliseconds payload_timeout = std::chrono::milliseconds(0));
  static constexpr uint64_t kDefaultPayloadBudget = 1ull << 30;
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  std::error_code start();
  // Closes every connection (abort) and joins the thread.
  void stop();

  // Runs `task` on the worker thread.
  void post(std::function<void(Worker&)> task);
  void adopt(int fd, Session session, std::unique_ptr<TlsConnection> tls = nullptr);
  // Drains (or, with `now`, aborts) every connection of `group` older than `below` (serial).
  void close_group(const std::string& group, bool now, uint64_t below = UINT64_MAX);
  // Every connection winds down (Connection::wind_down): the daemon stops.
  void wind_down();
  // Cuts off the connections (of `group` older than `below`; without a group, all) whose
  // client has taken none of its replies, or sent none of a payload, since before `since`.
  // Those only waiting for storage are left to finish.
  void cut_off_stalled(std::optional<std::string> group, uint64_t below,
                       std::chrono::steady_clock::time_point since);

  backend::Ring& ring() { return *ring_; }
  BufferPool& pool() { return pool_; }
  Request* get_request();
  void put_request(Request* r);
  void connection_finished(Connection* c);

  // The counters of `group`'s connections on this worker, made at its first connection. Worker
  // thread only.
  GroupCounters& counters_for(const std::string& group);
  // Adds this worker's counts into `into`, by group. Any thread.
  void collect(std::unordered_map<std::string, IoStats>& into) const;
  // Drops `group`'s counters once it is closed for good (its connections are gone).
  void forget_counters(const std::string& group);
  // Connections with replies to send once the current batch of completions is handled.
  void schedule_flush(Connection* c) { flushes_.push_back(c); }
  void cancel_flush(Connection* c);
  // A TLS connection has bytes to decrypt already: its tls_read() runs once the current batch
  // of completions is handled (and the worker does not sleep before).
  void schedule_tls_read(Connection* c) { tls_reads_.push_back(c); }
  void cancel_tls_read(Connection* c);

  // The payload bytes of every connection here. Each connection has its own limit, but a
  // thousand connections at theirs would hold more memory than the machine has: past the
  // worker's budget, connections read no new requests until replies free some.
  bool payload_budget_spent() const { return payload_bytes_ >= payload_budget_; }
  uint64_t payload_bytes() const { return payload_bytes_; }
  void payload_taken(uint64_t n) { payload_bytes_ += n; }
  void payload_returned(uint64_t n) { payload_bytes_ -= n; }
  // `c` stopped reading for the budget: it resumes once the budget has room again.
  void wait_for_budget(Connection* c);
  void cancel_wait_for_budget(Connection* c);
  // `c` holds requests for QoS: its qos_resume() runs once `when` has passed.
  QosTimers::iterator qos_wait(Connection* c, std::chrono::steady_clock::time_point when) {
    return qos_timers_.emplace(when, c);
  }
  void cancel_qos_wait(QosTimers::iterator it) { qos_timers_.erase(it); }
  // A connection queued a send on the ring because its socket was full / that send ended.
  void send_queued() { ++queued_sends_; }
  void send_ended() { --queued_sends_; }
  // A connection began / stopped waiting for a request's payload.
  void payload_awaited() { ++awaiting_payloads_; }
  void payload_ended() { --awaiting_payloads_; }

 private:
  struct Wakeup final : backend::Completion {
    Worker* worker;
    void complete(int res) override { worker->on_wakeup(res); }
  };
  void run(std::promise<std::error_code>* started);
  void on_wakeup(int res);
  // True while some send waits for room in its socket and hung clients are cut off.
  bool watching_sends() const { return queued_sends_ > 0 && send_timeout_.count() > 0; }
  // True while some connection awaits a payload and silent senders are cut off.
  bool watching_payloads() const { return awaiting_payloads_ > 0 && payload_timeout_.count() > 0; }
  bool watching() const { return watching_sends() || watching_payloads(); }
  int stall_check_ms() const;
  int wait_timeout_ms() const;
  void resume_qos_waiters();
  void cut_off_stalled_clients();

  ConnectionRegistry& registry_;
  std::unique_ptr<backend::Ring> ring_;
  BufferPool pool_;
  std::thread thread_;
  int event_fd_ = -1;
  uint64_t event_value_ = 0;
  Wakeup wakeup_;
  std::mutex mutex_;
  std::vector<std::function<void(Worker&)>> tasks_;
  std::unordered_set<Connection*> connections_;
  // Made and dropped by the worker thread, read by collect(): the lock guards the map, not the
  // counts (OwnedCounter), and is never taken per request.
  mutable std::mutex counters_mutex_;
  std::unordered_map<std::string, std::unique_ptr<GroupCounters>> counters_;
  std::vector<Request*> free_requests_;
  std::vector<Connection*> flushes_;
  std::vector<Connection*> flushing_;
  std::vector<Connection*> tls_reads_;
  std::vector<Connection*> tls_reading_;
  const uint64_t payload_budget_;
  uint64_t payload_bytes_ = 0;
  std::vector<Connection*> budget_waiters_;
  std::vector<Connection*> resuming_;
  QosTimers qos_timers_;
  const std::chrono::milliseconds send_timeout_;
  size_t queued_sends_ = 0;  // sends waiting on the ring for room in their socket
  const std::chrono::milliseconds payload_timeout_;
  size_t awaiting_payloads_ = 0;  // connections waiting for a request's payload
  std::chrono::steady_clock::time_point next_stall_check_;
  bool stopping_ = false;
};

}  // namespace shareblk::target
