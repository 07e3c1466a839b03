// A model of an NBD client in front of a server that costs nothing (bench/PROFILE.md, "What a
// perfect server would reach"). It keeps QD 4 KiB O_DIRECT random reads in flight on a file
// with io_uring, like fio's io_uring engine, but handles completions one at a time and burns
// COST_US of CPU on each before it issues the next read, as a one-thread client that spends
// that much on every reply would. COST_US=0 is the local limit of the disk.
//
//   cc -O2 -o /tmp/client_model bench/client_model.c -luring
//   /tmp/client_model FILE QD COST_US SECONDS [late]
//
// With "late", the next read is issued first and the CPU burnt after it (a client that sends
// before it handles the reply it got): the kinder model for the client.
#define _GNU_SOURCE
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void burn(double us) {
  const double end = now() + us * 1e-6;
  while (now() < end) {
  }
}

static void queue_read(struct io_uring* ring, int fd, char* buf, long blocks, unsigned slot) {
  struct io_uring_sqe* sqe = io_uring_get_sqe(ring);
  io_uring_prep_read(sqe, fd, buf + (size_t)slot * 4096, 4096, (__u64)(random() % blocks) * 4096);
  sqe->user_data = slot;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s FILE QD COST_US SECONDS [late]\n", argv[0]);
    return 2;
  }
  const unsigned qd = (unsigned)atoi(argv[2]);
  const double cost = atof(argv[3]);
  const double seconds = atof(argv[4]);
  const int late = argc > 5 && strcmp(argv[5], "late") == 0;
  const int fd = open(argv[1], O_RDONLY | O_DIRECT);
  if (fd < 0 || qd == 0) {
    perror(argv[1]);
    return 1;
  }
  const long blocks = lseek(fd, 0, SEEK_END) / 4096;
  struct io_uring ring;
  char* buf = NULL;
  if (blocks <= 0 || io_uring_queue_init(qd * 2, &ring, 0) < 0 ||
      posix_memalign((void**)&buf, 4096, (size_t)qd * 4096) != 0) {
    fprintf(stderr, "setup failed\n");
    return 1;
  }
  for (unsigned i = 0; i < qd; ++i) queue_read(&ring, fd, buf, blocks, i);
  io_uring_submit(&ring);
  long done = 0;
  const double start = now();
  while (now() - start < seconds) {
    struct io_uring_cqe* cqe = NULL;
    if (io_uring_wait_cqe(&ring, &cqe) < 0) return 1;
    const unsigned slot = (unsigned)cqe->user_data;
    if (cqe->res != 4096) {
      fprintf(stderr, "read failed: %d\n", cqe->res);
      return 1;
    }
    io_uring_cqe_seen(&ring, cqe);
    ++done;
    if (!late) burn(cost);
    queue_read(&ring, fd, buf, blocks, slot);
    io_uring_submit(&ring);
    if (late) burn(cost);
  }
  printf("qd=%u cost_us=%.1f%s iops=%.0f\n", qd, cost, late ? " late" : "",
         (double)done / (now() - start));
  return 0;
}
