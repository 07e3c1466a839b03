"""OpenStack glue for shareblk (docs/openstack.md).

- ``shareblk.cinder.ShareblkDriver``: a Cinder volume driver that talks JSON-RPC to
  shareblkd's control socket (``volume_driver = shareblk.cinder.ShareblkDriver``).
- ``shareblk.os_brick``: an os-brick connector for protocol ``NBD``, registered with
  ``shareblk.os_brick.register()`` (the Cinder driver registers it when it is imported).
- ``openstack/nova/*.patch``: the one ``VOLUME_DRIVERS`` entry Nova's libvirt driver needs.
"""
