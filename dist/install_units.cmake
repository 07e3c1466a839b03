# Run by `cmake --install` (dist/CMakeLists.txt): the units and the example config for the
# prefix given at install time (file(INSTALL) adds $DESTDIR itself). With the prefix /usr
# (the .deb) the config goes to /etc, where GNUInstallDirs puts sysconfdir for /usr; under
# any other prefix P, to P/etc.
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(sysconfdir "/etc")
else()
  set(sysconfdir "${CMAKE_INSTALL_PREFIX}/etc")
endif()
set(SHAREBLK_SBINDIR "${CMAKE_INSTALL_PREFIX}/${SHAREBLK_SBINDIR_REL}")
set(SHAREBLK_CONF "${sysconfdir}/shareblk/shareblkd.conf")
set(unit_dir "${CMAKE_INSTALL_PREFIX}/lib/systemd/system")

set(staging "${SHAREBLK_DIST_BINARY_DIR}/units")
foreach(unit shareblkd.service shareblk-helper.service)
  configure_file("${SHAREBLK_DIST_DIR}/systemd/${unit}.in" "${staging}/${unit}" @ONLY)
endforeach()
configure_file("${SHAREBLK_DIST_DIR}/systemd/privileged-helper.conf.in"
               "${staging}/privileged-helper.conf" @ONLY)
file(INSTALL "${staging}/shareblkd.service" "${SHAREBLK_DIST_DIR}/systemd/shareblkd.socket"
             "${SHAREBLK_DIST_DIR}/systemd/shareblkd-nbd.socket" "${staging}/shareblk-helper.service"
             "${SHAREBLK_DIST_DIR}/systemd/shareblk-helper.socket"
     DESTINATION "${unit_dir}" FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
# The drop-in that hands the daemon's root steps to the helper (docs/install.md, "Hardening").
file(INSTALL "${staging}/privileged-helper.conf"
     DESTINATION "${CMAKE_INSTALL_PREFIX}/${SHAREBLK_DOCDIR_REL}/examples"
     FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
file(INSTALL "${SHAREBLK_DIST_DIR}/shareblkd.conf" DESTINATION "${sysconfdir}/shareblk"
     FILE_PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
