// An LD_PRELOAD shim that lets fio's nbd engine read the TLS files a URI names.
//
// fio's nbd engine hands --uri to libnbd's nbd_connect_uri(). libnbd refuses query parameters
// that open local files (tls-psk-file, tls-certificates) unless the program first called
// nbd_set_uri_allow_local_file(h, true), and fio 3.33 never does:
//   nbd_connect_uri: local file access (tls-psk-file) is not allowed, call
//   nbd_set_uri_allow_local_file to enable this
// This shim interposes nbd_connect_uri (and the async nbd_aio_connect_uri): it makes that one
// call and then calls libnbd's own. Nothing else of fio or libnbd changes, so the TLS runs use
// the same client, engine and libnbd as the plain ones. bench/compare-tls builds and uses it.
//
//   cc -O2 -shared -fPIC -o /tmp/nbd_uri_local_files.so bench/nbd_uri_local_files.c -ldl
//   LD_PRELOAD=/tmp/nbd_uri_local_files.so fio --ioengine=nbd
//     --uri='nbds://alice@127.0.0.1:10809/vol?tls-psk-file=/abs/keys.psk' ...
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

struct nbd_handle;
typedef int (*connect_uri_fn)(struct nbd_handle*, const char*);
typedef int (*allow_fn)(struct nbd_handle*, bool);

static void allow_local_files(struct nbd_handle* h) {
  allow_fn allow = (allow_fn)dlsym(RTLD_NEXT, "nbd_set_uri_allow_local_file");
  if (allow == NULL || allow(h, true) == -1) {
    fprintf(stderr, "nbd_uri_local_files: nbd_set_uri_allow_local_file failed\n");
  }
}

int nbd_connect_uri(struct nbd_handle* h, const char* uri) {
  connect_uri_fn real = (connect_uri_fn)dlsym(RTLD_NEXT, "nbd_connect_uri");
  if (real == NULL) {
    fprintf(stderr, "nbd_uri_local_files: no nbd_connect_uri after this library\n");
    abort();
  }
  allow_local_files(h);
  return real(h, uri);
}

int nbd_aio_connect_uri(struct nbd_handle* h, const char* uri) {
  connect_uri_fn real = (connect_uri_fn)dlsym(RTLD_NEXT, "nbd_aio_connect_uri");
  if (real == NULL) {
    fprintf(stderr, "nbd_uri_local_files: no nbd_aio_connect_uri after this library\n");
    abort();
  }
  allow_local_files(h);
  return real(h, uri);
}
