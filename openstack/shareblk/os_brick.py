"""An os-brick connector for protocol NBD (docs/openstack.md, "os-brick").

Nova's guests never need it: QEMU is an NBD client itself (libvirt's network disk). A host
needs the volume as a local block device only for Cinder's own work (image <-> volume copies,
backups): then this connector makes one. It mounts the export as a file with ``nbdfuse``
and puts a loop device on that file. The kernel's ``nbd`` module (``nbd-client``) is not used
yet: the machines shareblk is tested on lack it, and untested code is not shipped.

os-brick has no entry point for connectors: ``register()`` adds ``NBD`` to its table of Linux
connectors in the running process (os-brick's files on disk stay as they are). The Cinder
driver calls it when it is imported.
"""

import os
import subprocess
import time
import urllib.parse

from os_brick import exception
from os_brick.initiator import connector as brick_connector
from os_brick.initiator.connectors import base

PROTOCOL = "NBD"
# Where the nbdfuse mounts go: one directory per connected export, named after it.
MOUNT_BASE = os.environ.get("SHAREBLK_NBD_MOUNT_BASE", "/run/shareblk-nbd")


def register():
    """Makes ``connector.InitiatorConnector.factory('nbd', ...)`` return NbdConnector."""
    brick_connector._connector_mapping_linux[PROTOCOL] = "shareblk.os_brick.NbdConnector"


def _uri(props):
    """The NBD URI of a connection_info's data (the Cinder driver's ``uri``, else built from
    ``hosts``/``ports``/``name``)."""
    if props.get("uri"):
        return props["uri"]
    host = props["hosts"][0]
    port = props["ports"][0]
    return f"nbd://{host}:{port}/{urllib.parse.quote(props['name'], safe='')}"


class NbdConnector(base.BaseLinuxConnector):
    """Attaches an NBD export as a local block device."""

    def __init__(self, root_helper, driver=None, *args, **kwargs):
        super().__init__(root_helper, driver=driver, *args, **kwargs)

    @staticmethod
    def get_connector_properties(root_helper, *args, **kwargs):
        return {}

    def get_search_path(self):
        return MOUNT_BASE

    def _mountpoint(self, props):
        return os.path.join(MOUNT_BASE, props["name"])

    def _loop_of(self, backing):
        out = subprocess.run(["losetup", "-j", backing, "-O", "NAME", "-n"],
                             capture_output=True, text=True, check=False).stdout.split()
        return out[0] if out else None

    def get_volume_paths(self, connection_properties):
        mount = self._mountpoint(connection_properties)
        loop = self._loop_of(os.path.join(mount, "nbd"))
        return [loop] if loop else []

    def get_all_available_volumes(self, connection_properties=None):
        return []

    def check_valid_device(self, path, run_as_root=True):
        try:
            with open(path, "rb") as f:
                f.read(512)
            return True
        except OSError:
            return False

    def connect_volume(self, connection_properties):
        props = connection_properties
        read_only = props.get("access_mode") == "ro"
        mount = self._mountpoint(props)
        os.makedirs(mount, exist_ok=True)
        pidfile = mount + ".pid"
        logfile = mount + ".log"
        for stale in (pidfile, logfile):
            if os.path.exists(stale):
                os.unlink(stale)
        # nbdfuse serves the mount until it is unmounted: it goes into a session of its own,
        # a child of init (setsid --fork), so that it outlives this call and is never left a
        # zombie of a long-running cinder-volume.
        argv = (["setsid", "--fork", "nbdfuse", "-P", pidfile] + (["-r"] if read_only else []) +
                [mount, _uri(props)])
        with open(logfile, "w") as log:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=False)
        for _ in range(500):  # nbdfuse writes its pid file once it serves the mount
            if os.path.exists(pidfile):
                break
            time.sleep(0.02)
        if not os.path.exists(pidfile):
            with open(logfile) as log:
                err = log.read().strip()
            subprocess.run(["fusermount3", "-u", mount], capture_output=True, check=False)
            raise exception.BrickException(f"nbdfuse could not mount {props['name']}: {err}")
        backing = os.path.join(mount, "nbd")
        loop = subprocess.run(["losetup", "-f", "--show", "--direct-io=off"] +
                              (["-r"] if read_only else []) + [backing],
                              capture_output=True, text=True, check=False)
        if loop.returncode != 0:
            subprocess.run(["fusermount3", "-u", mount], check=False)
            raise exception.BrickException(f"losetup {backing}: {loop.stderr.strip()}")
        return {"type": "block", "path": loop.stdout.strip(), "nbdfuse_mount": mount}

    def disconnect_volume(self, connection_properties, device_info, force=False,
                          ignore_errors=False):
        mount = self._mountpoint(connection_properties)
        loop = (device_info or {}).get("path") or self._loop_of(os.path.join(mount, "nbd"))
        errors = []
        if loop:
            r = subprocess.run(["losetup", "-d", loop], capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"losetup -d {loop}: {r.stderr.strip()}")
        if os.path.ismount(mount):
            r = subprocess.run(["fusermount3", "-u", mount], capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"fusermount3 -u {mount}: {r.stderr.strip()}")
        for leftover in (mount + ".pid", mount + ".log"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        try:
            os.rmdir(mount)
        except OSError:
            pass
        if errors and not ignore_errors:
            raise exception.BrickException("; ".join(errors))

    def extend_volume(self, connection_properties):
        # An NBD client learns the size once, at its handshake: a grown volume needs a new
        # connection, which a device in use cannot get under it.
        raise NotImplementedError("an NBD device keeps the size it connected with: "
                                  "disconnect and connect again")
