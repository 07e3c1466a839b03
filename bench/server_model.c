// A model of the cheapest NBD server that sleeps while it waits (bench/PROFILE.md, "The floor
// at QD1"). One thread, blocking calls, nothing else: read a request from the socket, pread()
// it from the file with O_DIRECT, send the simple reply and the data in one sendmsg(). No
// queue, no event loop, no structured replies; reads only. Every request costs it exactly
// the two waits any server that does not spin pays (the request, then the disk) and the three
// system calls it cannot do without. Its CPU per I/O at QD1 is a floor for shareblkd's.
//
//   cc -O2 -pthread -o /tmp/server_model bench/server_model.c
//   /tmp/server_model [-b] [-n] [-e] FILE SOCKET|tcp:PORT
//   fio --ioengine=nbd --uri='nbd+unix:///?socket=SOCKET' --rw=randread --bs=4k --iodepth=1 ...
//
// -b reads through the page cache instead (no O_DIRECT). -n reads nothing: every reply sends
// whatever the buffer holds, so the server costs only the receive and the send; with 1 MiB
// reads that is a ceiling for any one-thread server of one connection (bench/PROFILE.md,
// "Page-cache 1 MiB reads with the cache warm"). tcp:PORT listens on 127.0.0.1:PORT
// (TCP_NODELAY) instead of a Unix socket.
//
// It serves connections one after another until killed. -e serves them all at once instead,
// the way a server of many initiators must: one thread waits in epoll for any connection's
// requests and answers each as above (a request that came in part waits for the rest in its
// connection's buffer), while another takes new connections through their handshakes. Replies
// are sent blocking, as above. bench/initiators --model runs it so: what going from one
// initiator to 64 costs a server with nothing in it (bench/PROFILE.md, "64 initiators against
// one").
//
// Not a server for anything but this measurement: it trusts the client (lengths are capped,
// nothing else is checked).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

enum { kMaxLength = 1 << 20 };

// The socket blocks: MSG_WAITALL waits for all `n` bytes, and a stream send returns only once
// all are queued. Anything short is the end of the connection. A zero-length recv() would wait
// for one byte (an option with no data, such as STRUCTURED_REPLY), hence the n == 0 case.
static int read_full(int fd, void* buf, size_t n) {
  return n == 0 || recv(fd, buf, n, MSG_WAITALL) == (ssize_t)n ? 0 : -1;
}

static int write_full(int fd, const void* buf, size_t n) {
  return send(fd, buf, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
}

// Option reply (proto.md, "Option reply"): magic, option, type, length, then `len` bytes.
static int option_reply(int fd, uint32_t option, uint32_t type, const void* data, uint32_t len) {
  char head[20];
  uint64_t magic = htobe64(0x0003e889045565a9ULL);
  uint32_t o = htobe32(option), t = htobe32(type), l = htobe32(len);
  memcpy(head, &magic, 8);
  memcpy(head + 8, &o, 4);
  memcpy(head + 12, &t, 4);
  memcpy(head + 16, &l, 4);
  if (write_full(fd, head, sizeof head) != 0) return -1;
  return len ? write_full(fd, data, len) : 0;
}

// Fixed newstyle handshake, answering only NBD_OPT_GO; 0 once transmission begins.
static int handshake(int fd, uint64_t size) {
  char greeting[18];
  uint64_t m1 = htobe64(0x4e42444d41474943ULL), m2 = htobe64(0x49484156454f5054ULL);
  uint16_t flags = htobe16(1 | 2);  // FIXED_NEWSTYLE, NO_ZEROES
  memcpy(greeting, &m1, 8);
  memcpy(greeting + 8, &m2, 8);
  memcpy(greeting + 16, &flags, 2);
  uint32_t client_flags;
  if (write_full(fd, greeting, sizeof greeting) != 0) return -1;
  if (read_full(fd, &client_flags, 4) != 0) return -1;
  for (;;) {
    char head[16];
    if (read_full(fd, head, sizeof head) != 0) return -1;
    uint32_t option, len;
    memcpy(&option, head + 8, 4);
    memcpy(&len, head + 12, 4);
    option = be32toh(option);
    len = be32toh(len);
    if (len > 65536) return -1;
    char data[65536];
    if (read_full(fd, data, len) != 0) return -1;
    if (option == 2) return -1;  // NBD_OPT_ABORT
    if (option != 7) {           // anything but NBD_OPT_GO: NBD_REP_ERR_UNSUP
      if (option_reply(fd, option, 0x80000001u, NULL, 0) != 0) return -1;
      continue;
    }
    char info[12];  // NBD_INFO_EXPORT: type, size, transmission flags (HAS_FLAGS, READ_ONLY)
    uint16_t type = htobe16(0), tflags = htobe16(1 | 2);
    uint64_t sz = htobe64(size);
    memcpy(info, &type, 2);
    memcpy(info + 2, &sz, 8);
    memcpy(info + 10, &tflags, 2);
    if (option_reply(fd, option, 3, info, sizeof info) != 0) return -1;  // NBD_REP_INFO
    return option_reply(fd, option, 1, NULL, 0);                         // NBD_REP_ACK
  }
}

static int read_nothing;  // -n

// Answers one request; -1 ends the connection (NBD_CMD_DISC, or the reply could not be sent).
static int answer(int fd, const char* req, int file, char* buf) {
  uint16_t type;
  uint32_t length;
  uint64_t offset;
  memcpy(&type, req + 6, 2);
  memcpy(&offset, req + 16, 8);
  memcpy(&length, req + 24, 4);
  type = be16toh(type);
  offset = be64toh(offset);
  length = be32toh(length);
  if (type == 2) return -1;  // NBD_CMD_DISC
  uint32_t error = 0;
  if (type != 0 || length > kMaxLength) {
    error = 22;  // EINVAL: reads only
    length = 0;
  } else if (!read_nothing && pread(file, buf, length, (off_t)offset) != (ssize_t)length) {
    error = 5;  // EIO
    length = 0;
  }
  char reply[16];  // simple reply: magic, error, cookie
  uint32_t magic = htobe32(0x67446698), err = htobe32(error);
  memcpy(reply, &magic, 4);
  memcpy(reply + 4, &err, 4);
  memcpy(reply + 8, req + 8, 8);
  struct iovec iov[2] = {{reply, sizeof reply}, {buf, length}};
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = length ? 2 : 1};
  return sendmsg(fd, &msg, MSG_NOSIGNAL) == (ssize_t)(sizeof reply + length) ? 0 : -1;
}

static void serve(int fd, int file, char* buf) {
  char req[28];
  while (read_full(fd, req, sizeof req) == 0 && answer(fd, req, file, buf) == 0) {
  }
}

// The next client, through its handshake: its socket in transmission, or -1.
static int accept_client(int listener, int tcp, uint64_t size) {
  int fd = accept(listener, NULL, NULL);
  if (fd < 0) return -1;
  if (tcp) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  if (handshake(fd, size) == 0) return fd;
  close(fd);
  return -1;
}

// -e: every connection's requests, from one thread. A connection's socket stays blocking, so
// that a reply waits for room as in serve(); only receives are asked not to wait.
struct conn {
  int fd;
  size_t have;
  char req[28 * 64];
};

struct many {
  int epoll, listener, tcp, file;
  uint64_t size;
};

static void* accept_loop(void* arg) {
  struct many* m = arg;
  for (;;) {
    int fd = accept_client(m->listener, m->tcp, m->size);
    if (fd < 0) continue;
    struct conn* c = calloc(1, sizeof *c);
    if (c == NULL) {
      close(fd);
      continue;
    }
    c->fd = fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(m->epoll, EPOLL_CTL_ADD, fd, &ev) != 0) {
      free(c);
      close(fd);
    }
  }
  return NULL;
}

static void serve_many(struct many* m, char* buf) {
  pthread_t t;
  if (pthread_create(&t, NULL, accept_loop, m) != 0) exit(1);
  struct epoll_event events[64];
  for (;;) {
    int n = epoll_wait(m->epoll, events, 64, -1);
    for (int i = 0; i < n; i++) {
      struct conn* c = events[i].data.ptr;
      ssize_t got = recv(c->fd, c->req + c->have, sizeof c->req - c->have, MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      int end = got <= 0;
      if (!end) c->have += (size_t)got;
      size_t at = 0;
      for (; !end && c->have - at >= 28; at += 28) end = answer(c->fd, c->req + at, m->file, buf);
      memmove(c->req, c->req + at, c->have - at);
      c->have -= at;
      if (end) {
        epoll_ctl(m->epoll, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        free(c);
      }
    }
  }
}

static int listen_on(const char* where) {
  if (strncmp(where, "tcp:", 4) == 0) {
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET,
                               .sin_port = htons((uint16_t)atoi(where + 4)),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(listener, (struct sockaddr*)&addr, sizeof addr) != 0) return -1;
    return listen(listener, 128) == 0 ? listener : -1;
  }
  int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", where);
  unlink(where);
  if (bind(listener, (struct sockaddr*)&addr, sizeof addr) != 0) return -1;
  return listen(listener, 128) == 0 ? listener : -1;
}

int main(int argc, char** argv) {
  int flags = O_RDONLY | O_DIRECT;
  int opt, many = 0;
  while ((opt = getopt(argc, argv, "bne")) != -1) {
    if (opt == 'b')
      flags = O_RDONLY;
    else if (opt == 'n')
      read_nothing = 1;
    else if (opt == 'e')
      many = 1;
    else
      return 2;
  }
  if (argc - optind != 2) {
    fprintf(stderr, "usage: %s [-b] [-n] [-e] FILE SOCKET|tcp:PORT\n", argv[0]);
    return 2;
  }
  const char* path = argv[optind];
  const char* where = argv[optind + 1];
  int file = open(path, flags);
  struct stat st;
  if (file < 0 || fstat(file, &st) != 0) {
    perror(path);
    return 1;
  }
  char* buf = NULL;
  if (posix_memalign((void**)&buf, 4096, kMaxLength) != 0) return 1;
  int listener = listen_on(where);
  if (listener < 0) {
    perror(where);
    return 1;
  }
  const int tcp = strncmp(where, "tcp:", 4) == 0;
  if (many) {
    struct many m = {.epoll = epoll_create1(0),
                     .listener = listener,
                     .tcp = tcp,
                     .file = file,
                     .size = (uint64_t)st.st_size};
    serve_many(&m, buf);
  }
  for (;;) {
    int fd = accept_client(listener, tcp, (uint64_t)st.st_size);
    if (fd < 0) continue;
    serve(fd, file, buf);
    close(fd);
  }
}
