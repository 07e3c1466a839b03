"""The OpenStack glue against the real pieces (issue 24): Debian 12's python3-cinder, -os-brick
and -nova, a real shareblkd, QEMU's and libnbd's NBD clients, nbdfuse and a loop device.

Run with Debian's python (the pyenv one lacks these packages), openstack/ on the module path:
    SHAREBLKD=build/release/cmd/shareblkd PYTHONPATH=openstack \
        /usr/bin/python3 -m unittest discover -s openstack/tests
ctest runs it as openstack.python (with the same PYTHONPATH). A missing package or tool skips
(exit 77) with its reason, except under CI=true, where it fails.
"""

import importlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SHAREBLKD = os.environ.get("SHAREBLKD", str(ROOT / "build/release/cmd/shareblkd"))
NOVA_PATCH = HERE.parent / "nova" / "libvirt-nbd-volume-driver.patch"
INSTANCES = {}  # a test's instance names -> the UUIDs Cinder's objects want


def missing():
    """Why this suite cannot run here, or None."""
    try:
        for module in ("cinder", "nova", "os_brick", "nbd"):
            importlib.import_module(module)
    except ImportError as e:
        return f"needs Debian's python3-cinder, python3-nova, python3-os-brick, python3-libnbd ({e})"
    try:
        shareblk = importlib.import_module("shareblk")
    except ImportError:
        return f"needs {HERE.parent} on PYTHONPATH (the shareblk package under test)"
    if Path(shareblk.__file__).resolve().parent != HERE.parent / "shareblk":
        return (f"imports shareblk from {shareblk.__file__}, not the one under test: "
                f"needs {HERE.parent} first on PYTHONPATH")
    for tool in ("qemu-io", "nbdfuse", "losetup", "fusermount3", "patch"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not os.access(SHAREBLKD, os.X_OK):
        return f"needs shareblkd at {SHAREBLKD} (set SHAREBLKD)"
    if os.geteuid() != 0:
        return "needs root (loop devices and FUSE mounts for the os-brick connector)"
    return None


REASON = missing()
if REASON is None:
    from cinder import context, objects
    objects.register_all()
    from cinder import exception as cinder_exception
    from cinder.tests.unit import fake_snapshot, fake_volume
    from os_brick.initiator import connector as brick_connector
    from oslo_config import cfg

    from shareblk import cinder as shareblk_cinder
    from shareblk.control import ControlClient


class FakeConfiguration:
    """What a Cinder backend section gives a driver: attributes, defaults from the options."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def append_config_values(self, opts):
        for opt in opts:
            if not hasattr(self, opt.dest):
                setattr(self, opt.dest, opt.default)

    def safe_get(self, name):
        return getattr(self, name, None)


class FakeImageService:
    """Glance, which this machine does not run, in memory: what Cinder's image copies call of
    cinder.image.glance.GlanceImageService (show, download, update). An image's data is a file;
    an upload is written to a new file, sparse where it is zeros (a volume is GiBs, mostly
    zeros)."""

    CHUNK = 1 << 20

    def __init__(self, directory):
        self.directory = Path(directory)
        self.images = {}
        self.temp_images = None  # image_utils.TemporaryImages keeps its cache here

    def add(self, path, disk_format, status="active"):
        """An image as Glance has it: from a file, or ``queued`` (path None) for an upload."""
        image_id = str(uuid.uuid4())
        self.images[image_id] = {
            "id": image_id, "name": f"image-{image_id}", "status": status,
            "disk_format": disk_format, "container_format": "bare",
            "size": os.path.getsize(path) if path else None, "properties": {},
            "visibility": "private", "protected": False, "file": path}
        return self.show(None, image_id)

    def show(self, context, image_id):
        if image_id not in self.images:
            raise cinder_exception.ImageNotFound(image_id=image_id)
        meta = dict(self.images[image_id])
        del meta["file"]
        return meta

    def download(self, context, image_id, data=None):
        with open(self.images[image_id]["file"], "rb") as f:
            while chunk := f.read(self.CHUNK):
                data.write(chunk)

    def update(self, context, image_id, image_meta, data=None, purge_props=True,
               store_id=None, base_image_ref=None):
        image = self.images[image_id]
        if data is not None:
            path = self.directory / f"upload-{image_id}"
            size = 0
            with open(path, "wb") as f:
                while chunk := data.read(self.CHUNK):
                    if chunk.count(0) == len(chunk):
                        f.seek(len(chunk), os.SEEK_CUR)
                    else:
                        f.write(chunk)
                    size += len(chunk)
                f.truncate(size)
            image.update(file=str(path), size=size, status="active")
        image.update(image_meta)
        return self.show(context, image_id)


def qemu_io(uri, *commands, read_only=False):
    argv = ["qemu-io", "-f", "raw"] + (["-r"] if read_only else [])
    for c in commands:
        argv += ["-c", c]
    return subprocess.run(argv + [uri], capture_output=True, text=True, timeout=60)


def nbdfuse_serving(mounts):
    """The nbdfuse processes with a mount under ``mounts``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"nbdfuse" and \
                any(a.startswith(str(mounts).encode()) for a in argv):
            found.append(int(pid))
    return found


def release_leftovers(mounts):
    """What a failed os-brick disconnect left under ``mounts``: loop devices and nbdfuse
    mounts (so that the class's temporary directory can go)."""
    listing = subprocess.run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"],
                             capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name, _, backing = line.strip().partition(" ")
        if str(mounts) in backing:
            subprocess.run(["losetup", "-d", name], capture_output=True)
    for mount in mounts.iterdir():
        if os.path.ismount(mount):
            subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True)


def libnbd_write(uri):
    """Writes through libnbd whatever the export advertises; the errno it got, or 0."""
    script = ("import nbd, sys\n"
              "h = nbd.NBD()\n"
              "h.connect_uri(sys.argv[1])\n"
              "try:\n"
              "    h.pwrite(b'x' * 4096, 0)\n"
              "    print(0)\n"
              "except nbd.Error as e:\n"
              "    print(e.errno)\n")  # libnbd's errno: a number, or its name
    out = subprocess.run(["/usr/bin/python3", "-c", script, uri], capture_output=True,
                         text=True, timeout=60)
    return out.stdout.strip()


# libvirtd as root is the system daemon; as another user it is a session daemon, all its state
# under that user's XDG directories. nobody: a user every Debian has.
LIBVIRT_USER = "nobody"


def stop_by_pid(process):
    """Stops a daemon the test started, by its pid: SIGTERM, SIGKILL after 20 s."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def libvirt_missing():
    """Why a libvirt of the test's own cannot start a guest here, or None."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin"
    for tool in ("libvirtd", "virsh", "qemu-system-x86_64", "setpriv"):
        if shutil.which(tool, path=path) is None:
            return f"needs {tool} (Debian's libvirt-daemon, libvirt-clients, qemu-system-x86)"
    try:
        pwd.getpwnam(LIBVIRT_USER)
    except KeyError:
        return f"needs a user {LIBVIRT_USER} to run session libvirt as"
    return None


class SessionLibvirt:
    """A libvirtd of the test's own: session mode (qemu:///session) as an unprivileged user,
    with HOME and the XDG runtime, config and cache directories in ``directory``. The machine's
    libvirt (its config, sockets, daemons, domains) is never touched, and what this one leaves
    goes with the directory. Guests' QEMUs run as that user too."""

    def __init__(self, directory):
        self.dir = Path(directory)
        user = pwd.getpwnam(LIBVIRT_USER)
        self.uid, self.gid = user.pw_uid, user.pw_gid
        self.env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C",
                    # virsh would otherwise spawn a libvirtd of its own if ours is not up
                    "LIBVIRT_AUTOSTART": "0"}
        for var, sub in (("HOME", "home"), ("XDG_RUNTIME_DIR", "run"),
                         ("XDG_CONFIG_HOME", "config"), ("XDG_CACHE_HOME", "cache")):
            (self.dir / sub).mkdir(mode=0o700)
            os.chown(self.dir / sub, self.uid, self.gid)
            self.env[var] = str(self.dir / sub)
        conf = self.dir / "config" / "libvirt"
        conf.mkdir(mode=0o700)
        # QEMU's stdout and stderr straight to the domain's log file: no virtlogd to outlive us.
        (conf / "qemu.conf").write_text('stdio_handler = "file"\n')
        for p in (conf, conf / "qemu.conf"):
            os.chown(p, self.uid, self.gid)
        os.chown(self.dir, self.uid, self.gid)
        self.process = None
        self.qemu_pids = []

    def as_user(self, argv):
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"] + argv

    def start(self):
        self.log = open(self.dir / "libvirtd.log", "w")
        self.process = subprocess.Popen(self.as_user(["libvirtd"]), env=self.env,
                                        cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise AssertionError("libvirtd exited: " + self.log_text())
            if self.virsh("list", check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError("libvirtd not answering: " + self.log_text())
            time.sleep(0.1)

    def log_text(self):
        return (self.dir / "libvirtd.log").read_text(errors="replace")

    def virsh(self, *args, check=True):
        r = subprocess.run(self.as_user(["virsh", "-c", "qemu:///session", *args]),
                           env=self.env, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"virsh {' '.join(args)}: {r.stdout}{r.stderr}")
        return r

    def create(self, name, xml):
        """A transient domain; its QEMU's pid kept, to kill it if libvirt does not."""
        path = self.dir / f"{name}.xml"
        path.write_text(xml)
        os.chmod(path, 0o644)
        self.virsh("create", str(path))
        pidfile = self.dir / "run" / "libvirt" / "qemu" / "run" / f"{name}.pid"
        self.qemu_pids.append(int(pidfile.read_text()))

    def qmp(self, name, command, **arguments):
        r = self.virsh("qemu-monitor-command", name,
                       json.dumps({"execute": command, "arguments": arguments}))
        return json.loads(r.stdout)

    def hmp(self, name, command):
        return self.virsh("qemu-monitor-command", name, "--hmp", command).stdout

    def domain_log(self, name):
        return (self.dir / "cache" / "libvirt" / "qemu" / "log" / f"{name}.log").read_bytes()

    def stop(self):
        """Stops libvirtd by its pid, then kills any QEMU of ours it left running."""
        if self.process is not None:
            stop_by_pid(self.process)
        for pid in self.qemu_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.process is not None:
            self.log.close()


def alive(pid, program=b"qemu-system"):
    """The process runs ``program`` (a zombie, waiting for its reaper, does not; nor another
    process that got the pid since)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and program in os.path.basename(argv0)


@unittest.skipIf(REASON is not None and os.environ.get("CI") != "true", REASON or "")
class OpenStackTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if REASON is not None:  # under CI=true a skip is a failure
            raise AssertionError(REASON)
        cls.tmp = Path(tempfile.mkdtemp(prefix="shareblk-openstack."))
        cls.log = open(cls.tmp / "shareblkd.log", "w")
        cls.daemon = subprocess.Popen(
            [SHAREBLKD, "--state-dir", str(cls.tmp / "state"), "--listen-tcp", "127.0.0.1:0",
             "--workers", "1"], stdout=cls.log, stderr=subprocess.STDOUT)
        sock = cls.tmp / "state" / "shareblk.sock"
        for _ in range(500):
            if sock.exists():
                break
            time.sleep(0.02)
        cls.config = FakeConfiguration(shareblk_control_socket=str(sock),
                                       volume_backend_name="shareblk")
        cls.driver = shareblk_cinder.ShareblkDriver(configuration=cls.config, host="cv@shareblk")
        cls.ctx = context.get_admin_context()
        cls.driver.do_setup(cls.ctx)
        cls.driver.check_for_setup_error()
        cls.control = ControlClient(str(sock))

    @classmethod
    def tearDownClass(cls):
        stop_by_pid(cls.daemon)
        cls.log.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def new_volume(self, gib=1, multiattach=True):
        volume = fake_volume.fake_volume_obj(self.ctx, size=gib, multiattach=multiattach)
        volume.volume_attachment = objects.VolumeAttachmentList(objects=[])
        volume.update(self.driver.create_volume(volume))
        return volume

    def reserve(self, volume, instance):
        """What Cinder's attachment_create leaves for the driver to see: a reserved attachment."""
        attachment = objects.VolumeAttachment(context=self.ctx, id=str(uuid.uuid4()),
                                              volume_id=volume.id, instance_uuid=instance,
                                              attach_status="reserved")
        volume.volume_attachment.objects.append(attachment)
        return attachment

    def connect(self, volume, instance, host, mode):
        instance = INSTANCES.setdefault(instance, str(uuid.uuid4()))
        attachment = self.reserve(volume, instance)
        connector = {"host": host, "ip": "127.0.0.1", "mode": mode, "platform": "x86_64",
                     "os_type": "linux", "multipath": False}
        info = self.driver.initialize_connection(volume, connector)
        attachment.attach_status = "attached"
        return info, connector

    def test_a_volume_from_create_to_delete(self):
        volume = self.new_volume()
        shown = self.control.call("volume_show", {"volume_id": volume.provider_id})
        self.assertEqual(shown["size"], 1 << 30)
        self.assertTrue(shown["multiattach"])

        # Instance A read-write on host 1, instance B read-only on host 2.
        a, a_connector = self.connect(volume, "instance-a", "host1", "rw")
        b, b_connector = self.connect(volume, "instance-b", "host2", "ro")
        self.assertEqual(a["driver_volume_type"], "nbd")
        self.assertEqual(a["data"]["hosts"], ["127.0.0.1"])
        self.assertEqual((a["data"]["access_mode"], b["data"]["access_mode"]), ("rw", "ro"))
        self.assertNotEqual(a["data"]["name"], b["data"]["name"])
        for info, instance in ((a, "instance-a"), (b, "instance-b")):
            att = self.control.call("attachment_show", {
                "attachment_id": info["data"][shareblk_cinder.ATTACHMENT_KEY]})
            self.assertEqual((att["instance_uuid"], att["attach_status"]),
                             (INSTANCES[instance], "attached"))
            self.assertEqual(att["connector"]["ip"], "127.0.0.1")

        # QEMU opens each connection_info: A writes, B reads what A wrote and cannot write,
        # not even with a client that ignores the read-only flag.
        r = qemu_io(a["data"]["uri"], "write -P 0x5a 0 64k", "flush")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = qemu_io(b["data"]["uri"], "read -P 0x5a 0 64k", read_only=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = qemu_io(b["data"]["uri"], "write -P 0x11 0 4k")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn(libnbd_write(b["data"]["uri"]), ("1", "EPERM"))
        r = qemu_io(b["data"]["uri"], "read -P 0x5a 0 64k", read_only=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

        # A snapshot while A is attached, then A writes again: a volume made from the
        # snapshot has the bytes of the moment, a clone of the volume the bytes of now.
        snapshot = fake_snapshot.fake_snapshot_obj(self.ctx, volume_size=volume.size)
        snapshot.volume = volume
        snapshot.update(self.driver.create_snapshot(snapshot))
        shown = self.control.call("snapshot_show", {"snapshot_id": snapshot.provider_id})
        self.assertEqual((shown["status"], shown["volume_id"]), ("available", volume.provider_id))
        r = qemu_io(a["data"]["uri"], "write -P 0x6b 64k 4k", "flush")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        restored = fake_volume.fake_volume_obj(self.ctx, size=1, multiattach=False)
        restored.volume_attachment = objects.VolumeAttachmentList(objects=[])
        restored.update(self.driver.create_volume_from_snapshot(restored, snapshot))
        clone = fake_volume.fake_volume_obj(self.ctx, size=2, multiattach=False)
        clone.volume_attachment = objects.VolumeAttachmentList(objects=[])
        clone.update(self.driver.create_cloned_volume(clone, volume))
        self.assertEqual(self.control.call("volume_show",
                                           {"volume_id": clone.provider_id})["size"], 2 << 30)
        for copy, later in ((restored, "0"), (clone, "0x6b")):
            info, connector = self.connect(copy, "instance-c", "host3", "ro")
            r = qemu_io(info["data"]["uri"], "read -P 0x5a 0 64k", f"read -P {later} 64k 4k",
                        read_only=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.driver.terminate_connection(copy, connector)
            self.driver.delete_volume(copy)

        # Nova's libvirt driver, patched with the one VOLUME_DRIVERS entry, makes the disks.
        xml_a = self.nova_disk(a, multiattach=True)
        xml_b = self.nova_disk(b, multiattach=True)
        self.assertIn("protocol=\"nbd\"", xml_a)
        self.assertIn(f"name=\"{a['data']['name']}\"", xml_a)
        self.assertIn("<shareable/>", xml_a)
        self.assertNotIn("<readonly/>", xml_a)
        self.assertIn("<readonly/>", xml_b)
        # ...and QEMU with the -blockdev that disk stands for reads the volume.
        host, port, name = self.source_of(xml_b)
        r = subprocess.run(["qemu-io", "-r", "--image-opts",
                            f"driver=nbd,server.type=inet,server.host={host},"
                            f"server.port={port},export={name}",
                            "-c", "read -P 0x5a 0 64k"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

        # Detach: each terminate ends its own attachment only; its name opens nothing after.
        self.assertFalse(self.driver.terminate_connection(volume, b_connector))
        self.assertNotEqual(qemu_io(b["data"]["uri"], "read 0 4k", read_only=True).returncode, 0)
        r = qemu_io(a["data"]["uri"], "read -P 0x5a 0 64k", read_only=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.driver.terminate_connection(volume, a_connector)

        # Extend while detached (QEMU's NBD client cannot grow a live disk).
        self.driver.extend_volume(volume, 2)
        self.assertEqual(
            self.control.call("volume_show", {"volume_id": volume.provider_id})["size"], 2 << 30)
        self.assertFalse(self.driver.get_volume_stats(refresh=True)["online_extend_support"])

        # Its snapshot goes first.
        with self.assertRaises(cinder_exception.VolumeIsBusy):
            self.driver.delete_volume(volume)
        self.driver.delete_snapshot(snapshot)
        self.driver.delete_snapshot(snapshot)  # gone already: not an error
        self.driver.delete_volume(volume)
        with self.assertRaises(Exception) as caught:
            self.control.call("volume_show", {"volume_id": volume.provider_id})
        self.assertEqual(getattr(caught.exception, "reason", ""), "not_found")
        self.driver.delete_volume(volume)  # gone already: not an error

    def test_live_migration_attaches_the_same_instance_from_two_hosts(self):
        volume = self.new_volume(multiattach=False)
        source, source_connector = self.connect(volume, "instance-m", "host1", "rw")
        target, target_connector = self.connect(volume, "instance-m", "host2", "rw")
        # Another instance may not have a volume that is not multiattach.
        with self.assertRaises(cinder_exception.VolumeBackendAPIException):
            self.connect(volume, "instance-other", "host3", "rw")
        volume.volume_attachment.objects.pop()
        # The source host detaches; the target's connection goes on.
        self.driver.terminate_connection(volume, source_connector)
        self.assertNotEqual(qemu_io(source["data"]["uri"], "read 0 4k").returncode, 0)
        r = qemu_io(target["data"]["uri"], "write -P 0x77 0 4k")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with self.assertRaises(cinder_exception.VolumeIsBusy):
            self.driver.delete_volume(volume)
        self.driver.terminate_connection(volume, None)  # a forced detach of everything
        self.driver.delete_volume(volume)

    def test_os_brick_connects_a_local_device_through_nbdfuse(self):
        volume = self.new_volume()
        info, connector = self.connect(volume, "cinder-copy", "storage", "rw")
        mounts = self.tmp / "mounts"
        mounts.mkdir(exist_ok=True)
        with mock.patch("shareblk.os_brick.MOUNT_BASE", str(mounts)):
            conn = brick_connector.InitiatorConnector.factory("nbd", None)
            device = conn.connect_volume(info["data"])
            try:
                self.assertEqual(device["type"], "block")
                self.assertTrue(device["path"].startswith("/dev/loop"), device)
                self.assertEqual(conn.get_volume_paths(info["data"]), [device["path"]])
                with open(device["path"], "r+b", buffering=0) as dev:
                    dev.write(b"\x42" * 65536)
                    os.fsync(dev.fileno())
                    dev.seek(0)
                    self.assertEqual(dev.read(65536), b"\x42" * 65536)
            finally:
                conn.disconnect_volume(info["data"], device)
            self.assertEqual(conn.get_volume_paths(info["data"]), [])
        r = qemu_io(info["data"]["uri"], "read -P 0x42 0 64k", read_only=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.driver.terminate_connection(volume, connector)
        self.driver.delete_volume(volume)

    def test_cinder_copies_images_to_and_from_volumes_through_os_brick(self):
        """Cinder's generic copies (BaseVD.copy_image_to_volume, copy_volume_to_image) attach
        the volume on this host: the driver's initialize_connection, os-brick's NBD connector
        (nbdfuse, a loop device), qemu-img on the device, then detach and terminate."""
        work = self.tmp / "images"
        mounts = self.tmp / "copy-mounts"
        work.mkdir()
        mounts.mkdir()
        self.addCleanup(release_leftovers, mounts)
        # cinder.conf's settings, not mocks: image_utils' temporary files go to
        # image_conversion_dir (by default under /var/lib/cinder), and my_ip is the connector's
        # "ip", to which the driver binds the attachment: it must be the address this host's
        # NBD connections come from, here that of shareblkd's listener, 127.0.0.1.
        for name, value in (("image_conversion_dir", str(work / "conversion")),
                            ("my_ip", "127.0.0.1")):
            cfg.CONF.set_override(name, value)
            self.addCleanup(cfg.CONF.clear_override, name)
        for patch in (
                # Not a mock: SHAREBLK_NBD_MOUNT_BASE, read at import, for this test's mounts.
                mock.patch("shareblk.os_brick.MOUNT_BASE", str(mounts)),
                # The one mock of os-brick: it asks every protocol's connector for this host's
                # connector properties, and NVMe-oF's reads the DMI system UUID through
                # privsep, which this VM has not (no /sys/class/dmi): FileNotFoundError. What
                # it adds (nqn, host id) is NVMe's; NBD's connector and the driver use none.
                # (The other probes run for real, iSCSI's through os-brick's privsep daemon.)
                mock.patch("os_brick.initiator.connectors.nvmeof.NVMeOFConnector."
                           "get_connector_properties", return_value={})):
            patch.start()
            self.addCleanup(patch.stop)
        # Glance does not run here: an in-memory image service stands in for it.
        images = FakeImageService(work)
        # The root helper (sudo cinder-rootwrap, not installed) needs no mock: oslo's
        # processutils runs commands as they are when it is root already.
        host = socket.gethostname()  # os-brick's connector "host": the copies' attached_host

        # A raw image of 4 MiB, each 4 KiB block naming itself; a qcow2 image of 64 MiB with
        # two extents written, the rest unallocated (zeros).
        raw = work / "blocks.raw"
        raw.write_bytes(b"".join(f"shareblk image block {i:06d}\n".encode().ljust(4096, b"~")
                                 for i in range(1024)))
        qcow2 = work / "extents.qcow2"
        for argv in (["qemu-img", "create", "-q", "-f", "qcow2", str(qcow2), "64M"],
                     ["qemu-io", "-f", "qcow2", "-c", "write -P 0xc3 1M 2M",
                      "-c", "write -P 0x3c 40M 512k", str(qcow2)]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

        def cinder_volume():
            volume = self.new_volume()  # 1 GiB
            # What Cinder's database gives the volume manager with a volume.
            volume.volume_type = fake_volume.fake_volume_type_obj(self.ctx)
            volume.glance_metadata = {}
            return volume

        def copy_left_nothing(volume, copies):
            """No shareblk attachment of the volume is live; each copy had one of its own, for
            this host; no loop device, nbdfuse mount or nbdfuse process is left."""
            attachments = self.control.call("attachment_list",
                                            {"volume_id": volume.provider_id})
            self.assertEqual([a for a in attachments if a["attach_status"] != "detached"], [])
            self.assertEqual(len([a for a in attachments if a["attached_host"] == host]),
                             copies, attachments)
            loops = subprocess.run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"],
                                   capture_output=True, text=True, check=True).stdout
            self.assertEqual([line for line in loops.splitlines() if str(mounts) in line], [])
            with open("/proc/self/mountinfo") as f:
                self.assertEqual([line for line in f if str(mounts) in line], [])
            self.assertEqual(os.listdir(mounts), [])
            deadline = time.monotonic() + 10  # nbdfuse exits once it is unmounted
            while nbdfuse_serving(mounts) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(nbdfuse_serving(mounts), [])

        def compare(volume, path, fmt):
            """``qemu-img compare`` of an image file with the volume, read through a fresh
            read-only attachment (QEMU's NBD client, not os-brick): the two have the same
            bytes, and the larger one's extra bytes are zeros."""
            info, connector = self.connect(volume, "verify", "verifier", "ro")
            try:
                r = subprocess.run(["qemu-img", "compare", "-f", fmt, "-F", "raw", path,
                                    info["data"]["uri"]],
                                   capture_output=True, text=True, timeout=60)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            finally:
                self.driver.terminate_connection(volume, connector)

        # Raw image -> volume: the image's bytes at the volume's start, zeros after them.
        volume = cinder_volume()
        self.driver.copy_image_to_volume(self.ctx, volume, images,
                                         images.add(str(raw), "raw")["id"])
        copy_left_nothing(volume, copies=1)
        compare(volume, str(raw), "raw")

        # A guest writes the volume's last 64 KiB; then volume -> raw image: the upload is
        # exactly the volume's bytes, all 1 GiB of them.
        info, connector = self.connect(volume, "instance-w", "host1", "rw")
        r = qemu_io(info["data"]["uri"], f"write -P 0xa5 {(1 << 30) - 65536} 64k", "flush")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.driver.terminate_connection(volume, connector)
        upload = images.add(None, "raw", status="queued")
        self.driver.copy_volume_to_image(self.ctx, volume, images, upload)
        copy_left_nothing(volume, copies=2)
        uploaded = images.images[upload["id"]]
        self.assertEqual((uploaded["status"], uploaded["size"]), ("active", 1 << 30))
        with open(uploaded["file"], "rb") as f:
            self.assertEqual(f.read(4 << 20), raw.read_bytes())
            f.seek(-65536, os.SEEK_END)
            self.assertEqual(f.read(), b"\xa5" * 65536)
        compare(volume, uploaded["file"], "raw")
        self.driver.delete_volume(volume)

        # qcow2 image -> volume, converted to raw on the way; and back to a qcow2 image.
        volume = cinder_volume()
        self.driver.copy_image_to_volume(self.ctx, volume, images,
                                         images.add(str(qcow2), "qcow2")["id"])
        copy_left_nothing(volume, copies=1)
        compare(volume, str(qcow2), "qcow2")
        upload = images.add(None, "qcow2", status="queued")
        self.driver.copy_volume_to_image(self.ctx, volume, images, upload)
        copy_left_nothing(volume, copies=2)
        uploaded = images.images[upload["id"]]
        r = subprocess.run(["qemu-img", "info", "--output=json", uploaded["file"]],
                           capture_output=True, text=True, check=True)
        shown = json.loads(r.stdout)
        self.assertEqual((shown["format"], shown["virtual-size"]), ("qcow2", 1 << 30))
        compare(volume, uploaded["file"], "qcow2")
        self.driver.delete_volume(volume)
        self.assertEqual(os.listdir(work / "conversion"), [])  # no temporary file left

    def test_a_volume_types_back_end_qos_is_enforced_by_the_target(self):
        def typed(consumer, specs):
            volume = fake_volume.fake_volume_obj(self.ctx, size=1, multiattach=True)
            volume.volume_type = objects.VolumeType(
                self.ctx, id=str(uuid.uuid4()), name=f"limited-{consumer}",
                qos_specs=objects.QualityOfServiceSpecs(
                    self.ctx, id=str(uuid.uuid4()), name="q", consumer=consumer, specs=specs))
            volume.update(self.driver.create_volume(volume))
            self.addCleanup(self.driver.delete_volume, volume)
            return self.control.call("volume_show", {"volume_id": volume.provider_id})["qos"]

        specs = {"total_iops_sec": "500", "read_bytes_sec": "1048576",
                 "read_bytes_sec_max": "4194304",
                 "size_iops_sec": "10"}  # the last has no meaning at the target
        self.assertEqual(typed("back-end", specs), {"total_iops_sec": 500,
                                                    "read_bytes_sec": 1048576,
                                                    "read_bytes_sec_max": 4194304})
        self.assertEqual(typed("both", {"write_iops_sec": "20"}), {"write_iops_sec": 20})
        self.assertEqual(typed("front-end", specs), {})  # the hypervisor's to enforce
        # shareblk checks the spec as its own API does: a burst without its rate is refused.
        with self.assertRaises(cinder_exception.VolumeBackendAPIException):
            typed("back-end", {"write_iops_sec_max": "100"})
        self.assertTrue(self.driver.get_volume_stats(refresh=True)["QoS_support"])

    def test_stats_say_multiattach_and_nbd(self):
        stats = self.driver.get_volume_stats(refresh=True)
        self.assertTrue(stats["multiattach"])
        self.assertEqual(stats["storage_protocol"], "NBD")
        self.assertEqual(stats["volume_backend_name"], "shareblk")

    # --- Nova ---

    def test_libvirt_starts_a_guest_whose_qemu_reads_the_volume_through_novas_disk(self):
        """libvirt itself, from the disk XML Nova's patched driver makes of a read-only
        attachment's connection_info: the guest's QEMU connects to shareblkd and reads the
        volume; it cannot write through the disk, and shareblk's handshake told it why."""
        reason = libvirt_missing()
        if reason is not None:
            if os.environ.get("CI") == "true":  # under CI=true a skip is a failure
                self.fail(reason)
            self.skipTest(reason)
        volume = self.new_volume()
        a, a_connector = self.connect(volume, "instance-lw", "host1", "rw")
        r = qemu_io(a["data"]["uri"], "write -P 0x5a 0 64k", "flush")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.driver.terminate_connection(volume, a_connector)
        b, b_connector = self.connect(volume, "instance-lr", "host2", "ro")
        disk = self.nova_disk(b, multiattach=True)
        self.assertIn("<readonly/>", disk)
        host, port, name = self.source_of(disk)
        self.assertEqual(host, "127.0.0.1")  # the connector's IP, to which B is bound

        workdir = Path(tempfile.mkdtemp(prefix="shareblk-libvirt."))
        self.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
        libvirt = SessionLibvirt(workdir)
        self.addCleanup(libvirt.stop)  # after the domain's destroy: cleanups run last first
        libvirt.start()

        # TCG, 64 MiB, no OS: the firmware finds nothing to boot and waits; the disk is
        # Nova's element as it is.
        domain = f"shareblk-{uuid.uuid4().hex[:8]}"
        xml = ET.fromstring(
            f"<domain type='qemu'><name>{domain}</name><memory unit='MiB'>64</memory>"
            "<vcpu>1</vcpu><os><type arch='x86_64' machine='pc'>hvm</type></os>"
            "<devices><emulator/></devices></domain>")
        xml.find("devices/emulator").text = shutil.which(
            "qemu-system-x86_64", path=libvirt.env["PATH"])
        xml.find("devices").append(ET.fromstring(disk))
        libvirt.create(domain, ET.tostring(xml, encoding="unicode"))
        self.addCleanup(libvirt.virsh, "destroy", domain, check=False)

        # The guest's disk: libvirt's -blockdev of it, read-only, attached to the virtio device.
        blocks = libvirt.qmp(domain, "query-block")["return"]
        self.assertEqual(len(blocks), 1, blocks)
        self.assertTrue(blocks[0]["inserted"]["ro"], blocks)
        self.assertEqual(blocks[0]["inserted"]["file"], f"nbd://{host}:{port}/{name}")
        qdev = blocks[0]["qdev"]  # the device's BlockBackend: what the guest reads through

        def served(connections=None):
            """shareblkd's figures for B; first, for up to 10 s, until it has ``connections``
            (the server counts one when it is done with the handshake: QEMU may be first)."""
            deadline = time.monotonic() + 10
            while True:
                stats = self.control.call("stats", {
                    "attachment_id": b["data"][shareblk_cinder.ATTACHMENT_KEY]})
                stats = stats["attachments"][0]
                if connections in (None, len(stats["connections"])) or \
                        time.monotonic() > deadline:
                    return stats
                time.sleep(0.05)

        # shareblkd serves B to QEMU, connected from 127.0.0.1.
        stats = served(connections=1)
        self.assertEqual(len(stats["connections"]), 1, stats)
        self.assertTrue(stats["connections"][0]["peer"].startswith("tcp 127.0.0.1:"), stats)
        read_before = stats["ops"]["read"]["bytes"]

        def guest_qemu_io(command):
            """qemu-io on the guest's disk, through the monitor: what it printed. QEMU 7.2
            prints its findings to its stdout, the domain's log; its errors to the reply."""
            before = len(libvirt.domain_log(domain))
            out = libvirt.hmp(domain, f'qemu-io -d {qdev} "{command}"')
            return out + libvirt.domain_log(domain)[before:].decode(errors="replace")

        # QEMU reads the volume's bytes through the guest's disk. A wrong pattern fails: the
        # check checks.
        out = guest_qemu_io("read -P 0x5a 0 64k")
        self.assertIn("read 65536/65536 bytes at offset 0", out)
        self.assertNotIn("Pattern verification failed", out)
        out = guest_qemu_io("read -P 0 0 4k")
        self.assertIn("Pattern verification failed at offset 0, 4096 bytes", out)
        stats = served()
        self.assertGreaterEqual(stats["ops"]["read"]["bytes"] - read_before, 65536 + 4096)

        # No write: QEMU refuses it on the read-only disk, and cannot reopen the NBD node
        # read-write, for shareblk's handshake said the export is read-only.
        self.assertIn("Block node is read-only", guest_qemu_io("write -P 0x11 0 4k"))
        storage = [n for n in libvirt.qmp(domain, "query-named-block-nodes")["return"]
                   if n["drv"] == "nbd"]
        self.assertEqual(len(storage), 1, storage)
        r = libvirt.qmp(domain, "blockdev-reopen", options=[{
            "driver": "nbd", "node-name": storage[0]["node-name"], "read-only": False,
            "server": {"type": "inet", "host": host, "port": port}, "export": name}])
        self.assertIn("Can't reopen read-only NBD mount as read/write",
                      r.get("error", {}).get("desc", ""), r)
        stats = served()
        self.assertEqual((stats["ops"]["write"]["requests"], stats["refused_writes"]), (0, 0))
        out = guest_qemu_io("read -P 0x5a 0 64k")  # and the disk still reads
        self.assertIn("read 65536/65536 bytes at offset 0", out)
        self.assertNotIn("Pattern verification failed", out)

        # Destroyed, the guest's QEMU is gone and so is its connection.
        libvirt.virsh("destroy", domain)
        self.assertFalse(any(alive(pid) for pid in libvirt.qemu_pids))
        self.assertEqual(served(connections=0)["connections"], [])
        self.driver.terminate_connection(volume, b_connector)
        self.driver.delete_volume(volume)

    def nova_disk(self, info, multiattach):
        """The disk XML Nova's patched libvirt driver makes of a Cinder connection_info, from
        a copy of the installed nova package with openstack/nova's patch applied."""
        copy = self.tmp / "nova"
        if not copy.exists():
            import nova
            shutil.copytree(Path(nova.__file__).parent, copy / "nova")
            with open(NOVA_PATCH) as patch:
                r = subprocess.run(["patch", "-p1"], stdin=patch, cwd=copy,
                                   capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        connection_info = dict(info, multiattach=multiattach)
        script = (
            "import json, sys\n"
            "from unittest import mock\n"
            "import nova.conf\n"
            "from nova.virt.libvirt import driver\n"
            "from oslo_utils import importutils\n"
            "assert driver.__file__.startswith(sys.argv[2]), driver.__file__\n"
            "cls = importutils.import_class(driver.VOLUME_DRIVERS['nbd'])\n"
            "d = cls(mock.Mock())\n"
            "conf = d.get_config(json.loads(sys.argv[1]),\n"
            "                    {'dev': 'vdb', 'bus': 'virtio', 'type': 'disk'})\n"
            "print(conf.to_xml())\n")
        env = dict(os.environ, PYTHONPATH=str(copy))
        r = subprocess.run(["/usr/bin/python3", "-c", script, json.dumps(connection_info),
                            str(copy)], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout

    @staticmethod
    def source_of(xml):
        source = ET.fromstring(xml).find("source")
        host = source.find("host")
        return host.get("name"), host.get("port"), source.get("name")


if __name__ == "__main__":
    # ctest's entry (openstack.python): 77 is a skip, except under CI=true.
    if REASON is not None and os.environ.get("CI") != "true":
        print(f"skipped: {REASON}")
        sys.exit(77)
    unittest.main()
