# install.cmake - install rules for the systemd units, the tmpfiles.d and sysusers.d snippets, the
# example configuration and the manual pages. The top-level CMakeLists.txt includes it; paths are
# taken from this file's location. Destinations are relative to the install prefix
# (`cmake --install BUILD --prefix P`, `make install PREFIX=P`), and DESTDIR is honoured.
get_filename_component(EPD_SYSTEMD_SRC ${CMAKE_CURRENT_LIST_DIR} ABSOLUTE)
get_filename_component(EPD_MAN_SRC ${CMAKE_CURRENT_LIST_DIR}/../man ABSOLUTE)
set(EPD_SYSTEMD_STAGE ${CMAKE_BINARY_DIR}/systemd)

# epd.service names /usr/bin/epd. The prefix is only known at install time (--prefix overrides the
# configured one), so the unit is rewritten then: with the default /usr/local the installed unit
# starts /usr/local/bin/epd, which is where install(TARGETS epd) put it. file(INSTALL) adds DESTDIR
# and records the file in install_manifest.txt.
install(CODE "
  file(READ \"${EPD_SYSTEMD_SRC}/epd.service\" epd_unit)
  string(REPLACE \"ExecStart=/usr/bin/epd\" \"ExecStart=\${CMAKE_INSTALL_PREFIX}/bin/epd\"
         epd_unit \"\${epd_unit}\")
  file(WRITE \"${EPD_SYSTEMD_STAGE}/epd.service\" \"\${epd_unit}\")
  file(INSTALL DESTINATION \"\${CMAKE_INSTALL_PREFIX}/lib/systemd/system\" TYPE FILE
       FILES \"${EPD_SYSTEMD_STAGE}/epd.service\")
")
install(FILES ${EPD_SYSTEMD_SRC}/epd.socket DESTINATION lib/systemd/system)
install(FILES ${EPD_SYSTEMD_SRC}/epd.tmpfiles DESTINATION lib/tmpfiles.d RENAME epd.conf)
install(FILES ${EPD_SYSTEMD_SRC}/epd.sysusers DESTINATION lib/sysusers.d RENAME epd.conf)
# An example, not /etc/epd/epd.conf itself: the daemon runs on its defaults without one.
install(FILES ${EPD_SYSTEMD_SRC}/epd.conf DESTINATION share/doc/epd)
install(FILES ${EPD_MAN_SRC}/epd.8 ${EPD_MAN_SRC}/epctl.8 DESTINATION share/man/man8)
install(FILES ${EPD_MAN_SRC}/epd.conf.5 DESTINATION share/man/man5)
