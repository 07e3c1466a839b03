"""bench/compare's parts, one job each (the entry point is bench/compare).

- `cli`: the options, the run's set-up and cleanup, writing the report.
- `jobs`: the jobs (`--jobs`), and the order and restarts with which a transport runs them.
- `servers`: the servers (`--only`) and their command lines; `frontends`: shareblk's nbdkit
  plugin and FUSE attach, each behind its own managed shareblkd, called through
  `shareblk.control` (openstack/shareblk/control.py, reached through the symlink
  bench/shareblk: the one control-socket client of the tree).
- `measure`: the backing file, one fio run and what is read around it (CPU, page cache,
  disk), and the idle-connection RSS count.
- `fio`: how every benchmark in bench/ runs fio: options, job files, the JSON report, the
  time limit (bench/initiators, rbd-compare, ab-pagecache and qos-accuracy use it too).
- `report`: the markdown report and every rule of comparison (peers, best peer, targets).
- `tls`: all of bench/compare-tls (shareblkd with and without TLS, qemu-nbd with the same
  PSK); it uses measure, jobs' catalogue and servers, and nothing above uses it.
- `context`: the state a run shares (`Context`, `Result`) and the progress log; `procs`:
  processes started and stopped by pid; `nbd`: the handshake-only NBD client.

Imports go one way, with no cycles: cli -> report -> jobs -> frontends -> servers, and
jobs -> measure -> servers, measure -> fio (tls uses fio too); below them all are procs, nbd
and context. `report` only reads `Context.results`; it starts nothing.
"""
