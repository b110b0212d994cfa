# systemd integration tests (label `systemd`): the units pass `systemd-analyze verify`, the
# tmpfiles and sysusers snippets apply, epd serves a socket passed by systemd-socket-activate,
# speaks the sd_notify protocol (READY, STATUS, WATCHDOG, STOPPING), parses the example
# epd.conf, the documentation names every flag, key and command, and the install rules honour
# DESTDIR and the prefix. Each exits 77 (skipped) when the tool it needs is missing. Included by
# tests/CMakeLists.txt.
set(EPD_SYSTEMD_TEST ${CMAKE_CURRENT_LIST_DIR}/test_systemd.sh)
get_filename_component(EPD_SYSTEMD_TEST_SRC ${CMAKE_CURRENT_LIST_DIR}/.. ABSOLUTE)

foreach(part units activate notify config docs install)
  add_test(NAME systemd_${part}
    COMMAND bash ${EPD_SYSTEMD_TEST} ${part} ${EPD_SYSTEMD_TEST_SRC} $<TARGET_FILE_DIR:epd>
            ${CMAKE_BINARY_DIR} ${CMAKE_COMMAND})
  set_tests_properties(systemd_${part} PROPERTIES LABELS "systemd" TIMEOUT 120
    SKIP_RETURN_CODE 77)
endforeach()
