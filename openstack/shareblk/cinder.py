"""A Cinder volume driver for shareblk (docs/openstack.md).

Every Cinder volume is a shareblk volume, and every Cinder attachment a shareblk attachment of
its own: its own export name, its own mode. shareblk enforces that mode at the target's I/O
path (a read-only attachment's writes get EPERM), which no hypervisor setting can undo.

cinder.conf, in the backend's section::

    volume_driver = shareblk.cinder.ShareblkDriver
    shareblk_control_socket = /run/shareblk/shareblk.sock
    shareblk_nbd_host = 192.0.2.10      # where compute hosts reach shareblkd's NBD listener

The driver talks to shareblkd's control socket, so cinder-volume runs on the host that runs
shareblkd (as with the LVM driver and its target).
"""

import time
import urllib.parse

from oslo_config import cfg
from oslo_log import log as logging

from cinder import exception
from cinder import interface
from cinder.volume import configuration
from cinder.volume import driver

from shareblk import os_brick
from shareblk.control import ControlClient, ControlError

LOG = logging.getLogger(__name__)

shareblk_opts = [
    cfg.StrOpt("shareblk_control_socket", default="/run/shareblk/shareblk.sock",
               help="Path of shareblkd's control socket on this host."),
    cfg.StrOpt("shareblk_nbd_host", default=None,
               help="Address compute hosts connect to for NBD; by default the one in "
                    "shareblkd's connection_info (its --listen-tcp address)."),
    cfg.BoolOpt("shareblk_bind_ip", default=True,
                help="Bind each attachment to the connector's IP address: NBD clients from "
                     "any other address are refused."),
    cfg.StrOpt("shareblk_tls_dn_template", default=None,
               help="If set, each attachment is TLS-only and admits only the x509 client "
                    "certificate whose subject DN is this template with {host} replaced by "
                    "the connector's host (e.g. 'CN={host},O=Example'). Needs shareblkd "
                    "--tls on --tls-x509-dir and libvirt's nbd_tls on the compute hosts."),
    cfg.FloatOpt("shareblk_timeout", default=60.0,
                 help="Seconds to wait for one control call."),
    cfg.FloatOpt("shareblk_copy_timeout", default=3600.0,
                 help="Seconds to wait for a snapshot or a volume made from a snapshot or "
                      "volume to be whole (a reflink takes a moment; a copy, the data's "
                      "time)."),
]

CONF = cfg.CONF
CONF.register_opts(shareblk_opts, group=configuration.SHARED_CONF_GROUP)

# The key under which initialize_connection() leaves the shareblk attachment's id in the
# connector: Cinder's manager stores the connector it passed with the Cinder attachment and
# gives it back to terminate_connection(), which otherwise could not tell two attachments of
# one volume on one host apart.
ATTACHMENT_KEY = "shareblk_attachment_id"


def _size(gib):
    return f"{int(gib)}G"


# Cinder's QoS keys that shareblk enforces at the target (docs/qos.md): the rates and their
# bursts. Cinder's others (*_per_gb, size_iops_sec) have no meaning there.
QOS_KEYS = tuple(f"{kind}_{unit}_sec{burst}" for kind in ("total", "read", "write")
                 for unit in ("iops", "bytes") for burst in ("", "_max"))


def _qos_of(volume):
    """The shareblk ``qos`` of a volume: its type's QoS spec when the spec's consumer is
    ``back-end`` or ``both`` (a ``front-end`` one is the hypervisor's to enforce)."""
    if not volume.obj_attr_is_set("volume_type") or volume.volume_type is None:
        return {}
    vtype = volume.volume_type
    if not vtype.obj_attr_is_set("qos_specs") and not vtype.qos_specs_id:
        return {}
    specs = vtype.qos_specs
    if specs is None or specs.consumer not in ("back-end", "both"):
        return {}
    qos = {}
    for key, value in (specs.specs or {}).items():
        if key in QOS_KEYS:
            qos[key] = int(value)
        else:
            LOG.warning("QoS key %s of volume type %s is not enforced by shareblk", key,
                        vtype.name)
    return qos


@interface.volumedriver
class ShareblkDriver(driver.VolumeDriver):
    """Volumes and attachments on shareblkd (one multi-attach NBD target)."""

    VERSION = "0.1.0"
    CI_WIKI_NAME = "shareblk"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.configuration.append_config_values(shareblk_opts)
        self.backend_name = (self.configuration.safe_get("volume_backend_name") or
                             "shareblk")
        self.protocol = "nbd"
        self._client = None
        os_brick.register()  # Cinder's own copies (image <-> volume) attach through it

    @staticmethod
    def get_driver_options():
        return shareblk_opts

    # --- setup ---

    def do_setup(self, context):
        self._client = ControlClient(self.configuration.shareblk_control_socket,
                                     self.configuration.shareblk_timeout)

    def check_for_setup_error(self):
        self._call("volume_list")  # the daemon answers on its control socket

    def _call(self, method, params=None, ok_reasons=()):
        """One control call; a reason in ``ok_reasons`` returns None instead of raising."""
        try:
            return self._client.call(method, params)
        except ControlError as e:
            if e.reason in ok_reasons:
                return None
            if e.reason in ("volume_in_use", "volume_has_snapshots"):
                raise exception.VolumeIsBusy(volume_name=(params or {}).get("volume_id"))
            raise exception.VolumeBackendAPIException(data=str(e))
        except OSError as e:  # no socket, refused, timed out
            raise exception.VolumeBackendAPIException(
                data=f"shareblkd's control socket {self.configuration.shareblk_control_socket}:"
                     f" {e}")

    # --- volumes ---

    def _shareblk_id(self, cinder_object, list_method="volume_list"):
        """The shareblk volume (snapshot, with ``snapshot_list``) of a Cinder one: its
        provider_id, else found by name."""
        if cinder_object.provider_id:
            return cinder_object.provider_id
        for found in self._call(list_method):
            if found["name"] == cinder_object.name:
                return found["id"]
        return None

    def create_volume(self, volume, **source):
        """``source``: from_snapshot or from_volume, a shareblk id; the call then waits until
        the copy is whole."""
        params = {"name": volume.name, "size": _size(volume.size),
                  "multiattach": bool(volume.multiattach), **source}
        qos = _qos_of(volume)
        if qos:
            params["qos"] = qos
        v = self._call("volume_create", params)
        if source:
            self._wait_available("volume_show", "volume_id", v["id"])
        return {"provider_id": v["id"]}

    def _wait_available(self, method, key, shareblk_id):
        """Polls a volume or snapshot that is being copied until it is available."""
        deadline = time.monotonic() + self.configuration.shareblk_copy_timeout
        while True:
            shown = self._call(method, {key: shareblk_id})
            if shown["status"] == "available":
                return shown
            if shown["status"] != "creating":
                raise exception.VolumeBackendAPIException(
                    data=f"shareblk {shareblk_id}: {shown['status']}: "
                         f"{shown.get('status_reason')}")
            if time.monotonic() > deadline:
                raise exception.VolumeBackendAPIException(
                    data=f"shareblk {shareblk_id}: still creating after "
                         f"{self.configuration.shareblk_copy_timeout} s "
                         f"({shown.get('progress')} %)")
            time.sleep(0.1)

    def delete_volume(self, volume):
        volume_id = self._shareblk_id(volume)
        if volume_id is None:
            LOG.info("shareblk volume of %s is gone already", volume.id)
            return
        # Live attachments are Cinder's to delete first; volume_in_use says it did not.
        self._call("volume_delete", {"volume_id": volume_id, "wait": True},
                   ok_reasons=("not_found",))

    def extend_volume(self, volume, new_size):
        self._call("volume_extend", {"volume_id": self._shareblk_id(volume),
                                     "size": _size(new_size)})

    # Exports: a shareblk attachment is its own export, made by initialize_connection().
    def ensure_export(self, context, volume):
        pass

    def create_export(self, context, volume, connector):
        pass

    def remove_export(self, context, volume):
        pass

    # --- attachments ---

    @staticmethod
    def _instance_of(volume, connector):
        """The instance a connection is for. The driver is not told which Cinder attachment it
        serves; the one being connected is the volume's attachment still ``reserved`` (its
        connector is stored after this call). Live migration reserves the same instance
        twice, which shareblk admits for a volume that is not multiattach."""
        reserved = {a.instance_uuid for a in (volume.volume_attachment or [])
                    if a.attach_status == "reserved" and a.instance_uuid}
        if len(reserved) == 1:
            return reserved.pop()
        return f"host:{connector['host']}"  # no instance (Cinder's own copies), or ambiguous

    def initialize_connection(self, volume, connector):
        mode = connector.get("mode", "rw")
        shareblk_connector = {"host": connector["host"], "transport": "tcp"}
        if self.configuration.shareblk_bind_ip and connector.get("ip"):
            shareblk_connector["ip"] = connector["ip"]
        template = self.configuration.shareblk_tls_dn_template
        if template:
            shareblk_connector["tls_dn"] = template.format(host=connector["host"])
        attachment = self._call("attachment_create", {
            "volume_id": self._shareblk_id(volume),
            "instance_uuid": self._instance_of(volume, connector),
            "attached_host": connector["host"],
            "mode": "ro" if mode == "ro" else "rw",
            "connector": shareblk_connector})
        self._call("attachment_complete", {"attachment_id": attachment["id"]})
        connector[ATTACHMENT_KEY] = attachment["id"]
        data = attachment["connection_info"]["data"]
        uri = urllib.parse.urlsplit(data["uri"])
        host = self.configuration.shareblk_nbd_host or uri.hostname
        port = uri.port or 10809
        return {"driver_volume_type": "nbd",
                "data": {"name": data["export_name"], "hosts": [host], "ports": [str(port)],
                         "access_mode": data["access_mode"],
                         "tls": data.get("tls", False),
                         "uri": f"{uri.scheme}://{host}:{port}{uri.path}",
                         ATTACHMENT_KEY: attachment["id"]}}

    def terminate_connection(self, volume, connector, **kwargs):
        volume_id = self._shareblk_id(volume)
        if volume_id is None:
            return False
        live = [a for a in self._call("attachment_list", {"volume_id": volume_id},
                                      ok_reasons=("not_found",)) or []
                if a["attach_status"] != "detached"]
        if connector is None:  # a forced detach of every connection
            doomed = live
        elif connector.get(ATTACHMENT_KEY):
            doomed = [a for a in live if a["id"] == connector[ATTACHMENT_KEY]]
        else:
            doomed = [a for a in live if a["attached_host"] == connector.get("host")]
            if len(doomed) > 1:
                LOG.warning("%d shareblk attachments of volume %s on host %s and no way to "
                            "tell which one ends: detaching none",
                            len(doomed), volume.id, connector.get("host"))
                doomed = []
        for a in doomed:
            self._call("attachment_delete", {"attachment_id": a["id"]},
                       ok_reasons=("not_found",))
        # Every Cinder attachment has a shareblk connection of its own: none is shared.
        return False

    # --- snapshots and clones (docs/snapshots.md) ---

    def create_snapshot(self, snapshot):
        """Crash-consistent even while the volume is attached and written: shareblkd holds its
        writes at the target (they wait, never fail) until the snapshot is taken."""
        s = self._call("snapshot_create", {"volume_id": self._shareblk_id(snapshot.volume),
                                           "name": snapshot.name})
        self._wait_available("snapshot_show", "snapshot_id", s["id"])
        return {"provider_id": s["id"]}

    def delete_snapshot(self, snapshot):
        snapshot_id = self._shareblk_id(snapshot, "snapshot_list")
        if snapshot_id is None:
            LOG.info("shareblk snapshot of %s is gone already", snapshot.id)
            return
        self._call("snapshot_delete", {"snapshot_id": snapshot_id, "wait": True},
                   ok_reasons=("not_found",))

    def create_volume_from_snapshot(self, volume, snapshot):
        return self.create_volume(volume,
                                  from_snapshot=self._shareblk_id(snapshot, "snapshot_list"))

    def create_cloned_volume(self, volume, src_vref):
        return self.create_volume(volume, from_volume=self._shareblk_id(src_vref))

    # --- stats ---

    def _update_volume_stats(self):
        self._stats = {
            "volume_backend_name": self.backend_name,
            "vendor_name": "shareblk",
            "driver_version": self.VERSION,
            "storage_protocol": "NBD",
            # shareblkd does not report its store's capacity through the control socket.
            "total_capacity_gb": "unknown",
            "free_capacity_gb": "unknown",
            "reserved_percentage": self.configuration.safe_get("reserved_percentage") or 0,
            "multiattach": True,
            "thin_provisioning_support": True,
            # QEMU's NBD client keeps the size it saw at connect ("Cannot grow NBD nodes").
            "online_extend_support": False,
            # A volume type's back-end QoS spec becomes the volume's limits at the target.
            "QoS_support": True,
        }
