"""The OpenStack glue against the real pieces (issue 24): Debian 12's python3-cinder, -os-brick
and -nova, a real shareblkd, QEMU's and libnbd's NBD clients, nbdfuse and a loop device.

Run with Debian's python (the pyenv one lacks these packages):
    SHAREBLKD=build/release/cmd/shareblkd /usr/bin/python3 -m unittest discover -s openstack/tests
ctest runs it as openstack.python. A missing package or tool skips (exit 77) with its reason,
except under CI=true, where it fails.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
ROOT = HERE.parent.parent
SHAREBLKD = os.environ.get("SHAREBLKD", str(ROOT / "build/release/cmd/shareblkd"))
NOVA_PATCH = HERE.parent / "nova" / "libvirt-nbd-volume-driver.patch"
INSTANCES = {}  # a test's instance names -> the UUIDs Cinder's objects want


def missing():
    """Why this suite cannot run here, or None."""
    try:
        import cinder  # noqa: F401
        import nova  # noqa: F401
        import os_brick  # noqa: F401
        import nbd  # noqa: F401
    except ImportError as e:
        return f"needs Debian's python3-cinder, python3-nova, python3-os-brick, python3-libnbd ({e})"
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


def qemu_io(uri, *commands, read_only=False):
    argv = ["qemu-io", "-f", "raw"] + (["-r"] if read_only else [])
    for c in commands:
        argv += ["-c", c]
    return subprocess.run(argv + [uri], capture_output=True, text=True, timeout=60)


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
        cls.daemon.send_signal(signal.SIGTERM)
        try:
            cls.daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            cls.daemon.kill()
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

    def test_stats_say_multiattach_and_nbd(self):
        stats = self.driver.get_volume_stats(refresh=True)
        self.assertTrue(stats["multiattach"])
        self.assertEqual(stats["storage_protocol"], "NBD")
        self.assertEqual(stats["volume_backend_name"], "shareblk")

    # --- Nova ---

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
        import xml.etree.ElementTree as ET
        source = ET.fromstring(xml).find("source")
        host = source.find("host")
        return host.get("name"), host.get("port"), source.get("name")


if __name__ == "__main__":
    # ctest's entry (openstack.python): 77 is a skip, except under CI=true.
    if REASON is not None and os.environ.get("CI") != "true":
        print(f"skipped: {REASON}")
        sys.exit(77)
    unittest.main()
