// backend: a volume's bytes on a file or block device, the rules every frontend obeys, and the
// two engines that move the bytes.
//
// Every frontend (the NBD target, FUSE and the nbdkit plugin) reaches a volume only through a
// Handle. Two rules live here, once:
//   - capabilities(): what an attachment may do (read-only, trim, zero, fast zero, flush, FUA,
//     multi-conn, block status, cache). The NBD handshake, the nbdkit plugin's can_* callbacks
//     and FUSE's file mode all come from it.
//   - Handle::admit(): whether one request may run (read-only, write access, range, flags).
//     Every request of either engine passes it first, so no frontend can forget it.
// A third lives in WriteAccess: the fence that moves write access between the attachments of
// a single-writer volume, and that a live change to read-only closes.
// A request then runs as steps that dispatch.h maps from the op to system calls, the same for
// the synchronous engine (Handle::execute, for FUSE and nbdkit; sync.cc) and the io_uring one
// (Ring, for the NBD workers; ring.cc).
//
// Errors are positive errno values (0 = success) from here to the wire; nothing on the I/O path
// throws.
#pragma once

#include <sys/uio.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

struct io_uring;
struct msghdr;

namespace shareblk::backend {

class RemoteImage;

enum class AttachMode : uint8_t { ReadWrite, ReadOnly };

// "rw" / "ro": an attachment's mode as the API, the state database and the gateways' shared
// records write it (docs/api.md, "mode").
constexpr std::string_view to_string(AttachMode mode) {
  return mode == AttachMode::ReadOnly ? "ro" : "rw";
}
// The one parse of that text. Anything else is no mode: callers refuse it (a control call) or
// take it as read-only (a record written elsewhere) -- never as read-write.
constexpr std::optional<AttachMode> parse_attach_mode(std::string_view text) {
  if (text == "rw") return AttachMode::ReadWrite;
  if (text == "ro") return AttachMode::ReadOnly;
  return std::nullopt;
}

enum class Op : uint8_t { Read, Write, Flush, Trim, WriteZeroes, Cache };

// Per-request flags, as the frontends' protocols define them.
enum IoFlag : uint32_t {
  kFua = 1 << 0,       // durable before completion
  kNoHole = 1 << 1,    // write-zeroes must allocate (no punch)
  kFastZero = 1 << 2,  // write-zeroes must be fast or fail with ENOTSUP
};

// Opens a device for a volume: `flags` are open(2)'s (O_RDWR or O_RDONLY, O_CLOEXEC, perhaps
// O_DIRECT). Returns the descriptor, or -errno.
using DeviceOpener = std::function<int(const std::string& path, int flags)>;

struct OpenOptions {
  // O_DIRECT unless the file system refuses it or the file lives in memory (tmpfs, ramfs),
  // in which case the page cache is used: there it is the storage itself.
  bool direct = true;
  // How the volume's files and devices are opened, now and when a remap adds one: open(2) when
  // empty; the privileged helper's open when the daemon may not open them itself (privsep/).
  DeviceOpener open_device;
};

// `length` bytes at `offset` of the file or block device at `path`: one piece of a volume
// laid out over other devices (an LVM logical volume read without device-mapper).
struct MappedSegment {
  std::string path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// An open volume: a regular file or a block device, a map of segments on block devices, or an
// image in a remote store (RemoteImage). Shared by every connection to it. Thread-safe: members are
// immutable after open, atomic, or (segments) only ever appended to, published by a release store
// of their count.
class Volume {
 public:
  static std::shared_ptr<Volume> open(const std::string& path, std::error_code& ec,
                                      const OpenOptions& options = {});
  static std::shared_ptr<Volume> open_mapped(const std::vector<MappedSegment>& segments,
                                             std::error_code& ec, const OpenOptions& options = {});
  // The first `size` bytes of `image`, known by `name` in logs ("rbd:POOL/IMAGE").
  static std::shared_ptr<Volume> open_remote(std::shared_ptr<RemoteImage> image,
                                             const std::string& name, uint64_t size);
  ~Volume();
  Volume(const Volume&) = delete;
  Volume& operator=(const Volume&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_.load(std::memory_order_acquire); }
  bool is_block_device() const { return block_device_; }
  bool is_mapped() const { return mapped_; }
  bool is_direct() const { return direct_; }
  bool rotational() const { return rotational_; }
  // A file on tmpfs or ramfs. io_uring cannot read or write these without blocking (shmem
  // has no IOCB_NOWAIT), so it would hand every request to a worker thread; the engine copies
  // their pages inline instead, which never waits for a device.
  bool in_memory() const { return in_memory_; }
  // True when the daemon opened the backing by its path itself, so that another program it
  // runs (qemu-img) could open that path too; false when a privileged helper opened it.
  bool opened_by_path() const { return !open_device_; }
  // False when only a read-only descriptor could be opened.
  bool writable() const { return writable_; }
  // Offsets, lengths and buffer addresses that O_DIRECT accepts are multiples of this.
  uint32_t direct_alignment() const { return direct_align_; }

  // The remote image the bytes live in, or nullptr for files and devices.
  const std::shared_ptr<RemoteImage>& remote() const { return remote_; }
  // A remote volume's completions are reaped on one ring (see RemoteImage), so every
  // connection to it runs on one worker: the first to ask proposes `worker` and it stays the
  // volume's. Returns the volume's worker. Files and devices have none: returns `worker`.
  unsigned home_worker(unsigned worker);

  // Re-reads the size of a file, block device or remote image after it grew (volume_extend).
  // Returns errno.
  int refresh_size();
  // Grows a mapped volume: `segments` is the whole new map, which must begin with the current
  // one (the last current segment may have grown). Returns errno (EINVAL if it does not).
  int remap(const std::vector<MappedSegment>& segments);

  // Where the bytes at `offset` live: a descriptor, the offset there, and how many bytes of
  // `length` are contiguous from there. The descriptor is the O_DIRECT one when the range
  // and `buf` are aligned, else the buffered one (the kernel keeps the two coherent).
  // fd is -1 when `offset` is past the map.
  struct Location {
    int fd;
    uint64_t offset;
    uint64_t length;
  };
  Location locate(uint64_t offset, uint64_t length, const void* buf) const;
  // The same, always with the buffered descriptor (fallocate, fadvise).
  Location locate_buffered(uint64_t offset, uint64_t length) const {
    return locate(offset, length, nullptr);
  }

  // Where the bytes are, for another process to open the same volume: the segments of a map,
  // or the one file or device from offset 0; nothing for a remote image.
  std::vector<MappedSegment> layout() const;

  // The devices a flush must sync: one for a file or block device, each PV for a map.
  size_t device_count() const { return device_count_.load(std::memory_order_acquire); }
  int device_fd(size_t index) const { return devices_[index].buffered_fd; }

  // True once any byte may be unallocated; until then reads skip the hole scan.
  bool may_have_holes() const { return may_have_holes_.load(std::memory_order_relaxed); }
  void note_holes() {
    if (!block_device_) may_have_holes_.store(true, std::memory_order_relaxed);
  }

 private:
  static constexpr size_t kMaxDevices = 32;
  static constexpr size_t kMaxSegments = 256;
  struct Device {
    std::string path;
    int direct_fd = -1;
    int buffered_fd = -1;
  };
  struct Segment {
    uint64_t start = 0;  // offset in the volume
    std::atomic<uint64_t> length{0};
    uint64_t device_offset = 0;
    uint32_t device = 0;
  };

  Volume() = default;
  int add_device(const std::string& path, bool direct, uint32_t& index);

  std::string path_;
  bool block_device_ = false;
  bool mapped_ = false;
  bool direct_ = false;
  bool rotational_ = false;
  bool in_memory_ = false;
  bool writable_ = true;
  uint32_t direct_align_ = 4096;
  std::atomic<uint64_t> size_{0};
  std::atomic<bool> may_have_holes_{true};
  std::array<Device, kMaxDevices> devices_;
  std::atomic<size_t> device_count_{0};
  std::array<Segment, kMaxSegments> segments_;  // mapped volumes only
  std::atomic<size_t> segment_count_{0};
  std::shared_ptr<RemoteImage> remote_;
  std::atomic<int> home_worker_{-1};
  DeviceOpener open_device_;  // empty: open(2)
};

// Whether one attachment may change the volume now (docs/fencing.md). Shared by every Handle of
// the attachment, in every frontend and thread. A change (write, trim, write-zeroes) enters
// when it is admitted and leaves when its last step has completed; revoke() closes the gate
// and returns only once every change that entered has left. So when revoke() returns, no
// change of this attachment is running, and none will start until grant(): NVMe's
// preempt-and-abort guarantee, which the Linux target gives the same way (it waits for the
// preempted host's commands instead of aborting them).
// pause() is the same wait without the refusal: a change that meets a paused gate waits (the
// engine holds it) until resume(), so that a snapshot sees the volume between requests
// (docs/snapshots.md, "Crash consistency").
class WriteAccess {
 public:
  explicit WriteAccess(bool granted) : granted_(granted) {}
  WriteAccess(const WriteAccess&) = delete;
  WriteAccess& operator=(const WriteAccess&) = delete;

  bool granted() const { return granted_.load(std::memory_order_seq_cst); }
  void grant() { granted_.store(true, std::memory_order_seq_cst); }
  // Closes the gate, then waits for the changes in flight: a change stuck in the kernel holds
  // it up (the engines have no way to abort one that has started).
  void revoke();
  // Holds new changes, then waits for the changes in flight, as revoke() does. Pauses nest:
  // changes go on once every pause() has had its resume().
  void pause();
  void resume();
  bool paused() const { return pauses_.load(std::memory_order_seq_cst) != 0; }
  // For the synchronous engine: returns once the gate is not paused.
  void wait_resumed() const;
  // Changes admitted and not yet finished (for tests and logs).
  uint32_t in_flight() const { return in_flight_.load(std::memory_order_seq_cst); }

  // For the engines, once per change: enter() says whether it may start, and counts it if so;
  // leave() once it is done. Sequentially consistent on both sides, so that a change either
  // sees the gate closed or is seen by revoke() as in flight.
  // Refused (revoked) wins over Paused; both are decided from the one look at the gate, so a
  // change refused by a revoke stays refused whatever the gate does next.
  enum class Entry : uint8_t { Entered, Refused, Paused };
  Entry enter() {
    in_flight_.fetch_add(1, std::memory_order_seq_cst);
    const bool granted = granted_.load(std::memory_order_seq_cst);
    const bool paused = pauses_.load(std::memory_order_seq_cst) != 0;
    if (granted && !paused) return Entry::Entered;
    leave();
    return granted ? Entry::Paused : Entry::Refused;
  }
  void leave() {
    if (in_flight_.fetch_sub(1, std::memory_order_seq_cst) == 1) in_flight_.notify_all();
  }

 private:
  void wait_drained();
  std::atomic<bool> granted_;
  std::atomic<uint32_t> in_flight_{0};  // 32 bits: a futex waits on it directly
  std::atomic<uint32_t> pauses_{0};
};

// The result of a change whose attachment's write access is paused (WriteAccess::pause):
// nothing was done, and the engine runs it again once the pause is over.
inline constexpr int kPaused = EAGAIN;

// Whether `op` changes the volume's bytes: what a read-only attachment and WriteAccess refuse.
inline bool is_change(Op op) {
  return op == Op::Write || op == Op::Trim || op == Op::WriteZeroes;
}

// What an attachment may do: computed once, by capabilities(), for every frontend. Each frontend
// maps it to its own terms (NBD transmission flags, nbdkit's can_* answers, a FUSE file mode).
// trim, zero and fast_zero are false exactly when read_only is true, so Handle::admit()'s EPERM
// enforces all four on every request; the rest are always true.
struct Capabilities {
  bool read_only;  // no write, trim or write-zeroes: admit() says EPERM
  bool trim;       // trim (a hint: where the device cannot discard it changes nothing)
  bool zero;       // write-zeroes, with or without NO_HOLE
  bool fast_zero;  // write-zeroes with FAST_ZERO: ENOTSUP, changing nothing, where it would be slow
  bool flush;      // a data sync of every device the volume lies on
  bool fua;        // requests may ask to be durable on completion (kFua)
  bool multi_conn;    // a flush on any connection covers every connection's completed writes
  bool block_status;  // allocation status (Handle::extents, NBD base:allocation)
  bool cache;         // a read-ahead hint (Op::Cache)
};

// One attachment's capabilities on `volume` in `mode`. The frontends serve the same volume
// through one file or device set, so they may all say the same thing. Inline: admit() asks it
// for every change.
inline Capabilities capabilities(const Volume& volume, AttachMode mode) {
  const bool read_only = mode == AttachMode::ReadOnly || !volume.writable();
  Capabilities c{};
  c.read_only = read_only;
  // Trim and write-zeroes are changes; each engine does them natively (fallocate, or zero
  // bytes written where it cannot), and FAST_ZERO fails with ENOTSUP instead of writing.
  c.trim = !read_only;
  c.zero = !read_only;
  c.fast_zero = !read_only;
  // FUA is RWF_DSYNC on a write, or a data sync after a trim or write-zeroes.
  c.flush = true;
  c.fua = true;
  // Every connection writes the same file or devices, and a flush is fdatasync of those, which
  // covers writes made through any descriptor of them.
  c.multi_conn = true;
  c.block_status = true;  // SEEK_DATA/SEEK_HOLE on files; a device is all data
  c.cache = true;         // posix_fadvise(WILLNEED)
  // A remote image says the same (RemoteImage): its store acknowledges a write once it is
  // durable, so FUA and a flush on any connection hold as they do for a file.
  return c;
}

// One extent of base:allocation status.
struct Extent {
  uint64_t length;
  bool hole;  // unallocated, reads as zeroes
};

// A volume whose bytes live behind an asynchronous client library rather than in files: an
// RBD image through librbd (rbd/rbd_store.h). Its requests are not system calls: the io_uring
// engine start()s each as one library call, learns that some have ended when event_fd() is
// readable (it keeps a read of it on its ring), and poll()s them on its own thread, so the
// library's threads never run our code and a completion is handled by the thread that owns the
// connection. That is why a remote volume's connections share one ring (Volume::home_worker).
// The synchronous engine (FUSE) calls execute() instead. Thread-safe.
// Write access, admission and pauses stay the engines' (dispatch.h begin/end), as for files.
class RemoteImage {
 public:
  virtual ~RemoteImage() = default;

  // Starts an admitted request of `length` bytes at `offset` (`buf`: Read, Write). Its result
  // comes from a later poll(), with `tag`. Returns 0, or an errno when it did not start (and
  // poll() will not report it). The store acknowledges a write once it is durable, so kFua needs
  // nothing more, and Flush never comes here: the engines answer it at once, as they answer the
  // Cache hint (a flush through the store could only wait, for the image's lock held by another
  // client, and have nothing to write).
  virtual int start(Op op, uint32_t flags, uint64_t offset, uint64_t length, char* buf,
                    void* tag) = 0;
  struct Completed {
    void* tag;
    int err;  // 0 or a positive errno
  };
  // Up to `max` of the started requests that have ended; the caller's thread only.
  virtual size_t poll(Completed* out, size_t max) = 0;
  // An eventfd counting ended requests, read by the ring that poll()s them.
  virtual int event_fd() const = 0;
  // The volume is gone: the reader of event_fd() is woken, sees orphaned(), and lets go.
  virtual void orphan() = 0;
  virtual bool orphaned() const = 0;

  // Runs an admitted request on this thread, waiting for its end. Returns errno.
  virtual int execute(Op op, uint32_t flags, uint64_t offset, uint64_t length, char* buf) = 0;
  // Allocation of [offset, offset+length), as Handle::extents describes it.
  virtual int extents(uint64_t offset, uint64_t length, size_t max_extents,
                      std::vector<Extent>& out) = 0;
  // The image's size as the store has it now (after volume_extend). Returns errno.
  virtual int size(uint64_t& out) = 0;
  // False when the image can only be read.
  virtual bool writable() const = 0;
};

// A volume as one attachment sees it. Cheap to copy; every frontend request goes through it.
class Handle {
 public:
  Handle() = default;
  // `access`: the attachment's write access; nullptr for an export that always has it (the
  // standalone --export table) when `mode` is read-write.
  Handle(std::shared_ptr<Volume> volume, AttachMode mode,
         std::shared_ptr<WriteAccess> access = nullptr)
      : volume_(std::move(volume)), mode_(mode), access_(std::move(access)) {}

  // The single admission rule, for every frontend and both engines: 0, or, in this order,
  //   EPERM  a write, trim or write-zeroes through a read-only attachment (capabilities()),
  //          or through one that does not hold write access now (WriteAccess);
  //   EINVAL a flag the operation does not take (kFua: every operation, as NBD allows it on
  //          every command; kNoHole, kFastZero: WriteZeroes only);
  //   ENOSPC a write or write-zeroes reaching past the end (NBD "Error values");
  //   EINVAL any other request reaching past the end.
  int admit(Op op, uint64_t offset, uint64_t length, uint32_t flags = 0) const;

  const std::shared_ptr<Volume>& volume() const { return volume_; }
  AttachMode mode() const { return mode_; }
  const std::shared_ptr<WriteAccess>& write_access() const { return access_; }

  // For the engines, around every request admit() let through: enter() counts a change in
  // the attachment's WriteAccess (Refused: it was revoked since admit(), so EPERM; Paused: run
  // it again later), leave() once its last step completed.
  WriteAccess::Entry enter(Op op) const {
    return !access_ || !is_change(op) ? WriteAccess::Entry::Entered : access_->enter();
  }
  void leave(Op op) const {
    if (access_ && is_change(op)) access_->leave();
  }
  Capabilities capabilities() const { return backend::capabilities(*volume_, mode_); }
  // The attachment is read-only, or the volume could only be opened read-only.
  bool read_only() const { return !volume_ || backend::capabilities(*volume_, mode_).read_only; }

  // Allocation status of [offset, offset+length): extents in order, at most max_extents,
  // covering at least one byte. Uses SEEK_DATA/SEEK_HOLE; block devices are all data.
  int extents(uint64_t offset, uint64_t length, size_t max_extents, std::vector<Extent>& out) const;

  // The synchronous engine, for frontends that run on their own threads (FUSE, nbdkit): admits
  // the request and runs it on this thread. `buf` is read into (Read) or written from (Write),
  // and may lie anywhere in memory. Returns errno.
  int execute(Op op, void* buf, uint64_t length, uint64_t offset, uint32_t flags) const;
  int read(void* buf, uint64_t length, uint64_t offset) const {
    return execute(Op::Read, buf, length, offset, 0);
  }
  int write(const void* buf, uint64_t length, uint64_t offset, uint32_t flags) const {
    return execute(Op::Write, const_cast<void*>(buf), length, offset, flags);  // only read from
  }
  int flush() const { return execute(Op::Flush, nullptr, 0, 0, 0); }
  int trim(uint64_t length, uint64_t offset, uint32_t flags) const {
    return execute(Op::Trim, nullptr, length, offset, flags);
  }
  int write_zeroes(uint64_t length, uint64_t offset, uint32_t flags) const {
    return execute(Op::WriteZeroes, nullptr, length, offset, flags);
  }

 private:
  std::shared_ptr<Volume> volume_;
  AttachMode mode_ = AttachMode::ReadOnly;
  std::shared_ptr<WriteAccess> access_;
};

// Where a request is among its steps (backend/dispatch.h); kept by the engine that runs it.
struct DispatchCursor {
  uint64_t progress = 0;  // bytes (or, for syncs, devices) done so far in this stage
  uint64_t chunk = 0;     // bytes of the fallocate in flight
  uint8_t stage = 0;
};

// What the engine calls when an operation it was given finishes. `res` is the io_uring result
// for raw operations (bytes or -errno) and 0 or a positive errno for volume requests.
class Completion {
 public:
  virtual void complete(int res) = 0;

 protected:
  virtual ~Completion() = default;
};

// A request against a volume, submitted through Ring::submit. The caller owns it and keeps it
// alive until complete() runs; the engine keeps its progress in the private fields.
class IoRequest : public Completion {
 public:
  Op op = Op::Read;
  uint32_t flags = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  char* buf = nullptr;  // Read, Write: `length` bytes; best aligned to 4096 for O_DIRECT
  int buf_index = -1;   // `buf` lies in this Ring::register_buffer() buffer, or -1
  // A page-cache write of 256 KiB or more is copied into the page cache on an io-wq thread,
  // beside the ring's, not on it: for a frontend whose thread is the slower side and has the
  // next payload to receive meanwhile (an NBD worker reading a Unix socket; see ring.cc).
  bool copy_writes_beside = false;

  // Called once with 0 or a positive errno.
  virtual void done(int err) = 0;

 protected:
  ~IoRequest() override = default;

 private:
  friend class Ring;
  void complete(int res) final;
  class Ring* ring_ = nullptr;
  const Handle* handle_ = nullptr;
  DispatchCursor cursor_;
};

// One io_uring, owned by one thread. Socket and disk operations of that thread's connections
// share it, so a request's receive, disk I/O and reply never change threads.
class Ring {
 public:
  explicit Ring(unsigned entries, std::error_code& ec);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Admits the request through `handle` and starts it; done() runs from a later run_once()
  // (or at once, with the admission error). `handle` must outlive the request. A change met by
  // a paused write access gets done(kPaused) at once, having done nothing: the caller holds it
  // and submits it again later (the engine has no timer of its own).
  void submit(const Handle& handle, IoRequest* request);

  // Registers [buf, buf+length) with the kernel, so that reads and writes into it skip pinning
  // its pages on every request (with O_DIRECT, 4 KiB requests spent ~4% of the server's CPU
  // there). Returns the index to put in IoRequest::buf_index, or -1 when the ring's table is
  // full or the kernel refuses (locked-memory limit, old kernel); the buffer then works as
  // before. The memory must stay allocated until unregister_buffer(index) or the ring's end.
  int register_buffer(void* buf, size_t length);
  void unregister_buffer(int index);

  // Raw operations; `done->complete(res)` gets the io_uring result.
  // recv `once_readable`: no attempt before the socket polls readable (which SO_RCVLOWAT can
  // put off until enough has come); kernels before 5.19 try at once.
  void recv(int fd, void* buf, size_t length, Completion* done, bool once_readable = false);
  void sendmsg(int fd, const msghdr* msg, Completion* done);
  void read(int fd, void* buf, size_t length, Completion* done);

  // Submits what is queued, waits for at least one completion (or `timeout_ms`, -1 = forever),
  // and dispatches every completion that is ready. Returns the number dispatched.
  int run_once(int timeout_ms = -1);

 private:
  friend class IoRequest;
  struct io_uring_sqe* next_sqe();
  void start(IoRequest* request);
  // A remote volume's request: one library call; its end comes through the image's eventfd.
  void start_remote(IoRequest* request);
  void finish_remote(IoRequest* request, int err);
  class RemoteReaper;
  // Keeps a read of `image`'s eventfd on this ring; false when it cannot (then EIO).
  bool reap(const std::shared_ptr<RemoteImage>& image);
  void drop_reaper(const RemoteReaper* reaper);
  std::unique_ptr<io_uring> ring_;
  std::vector<std::unique_ptr<RemoteReaper>> reapers_;
  std::vector<int> free_buffer_slots_;  // empty when the kernel has no table for us
  bool poll_first_ = false;             // IORING_RECVSEND_POLL_FIRST is known (5.19+)
};

}  // namespace shareblk::backend
