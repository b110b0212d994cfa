# Unit suites (Check, fork mode) and the test library shared with integration tests and the
# benchmark. Included by tests/CMakeLists.txt; paths are taken from this file's location so the
# file does not depend on which directory includes it.
get_filename_component(EPD_ROOT_DIR ${CMAKE_CURRENT_LIST_DIR}/.. ABSOLUTE)

# The independent reference and the seeded data generators. They need epd.h for the enums only.
add_library(epd_testlib STATIC
  ${CMAKE_CURRENT_LIST_DIR}/reference.c
  ${CMAKE_CURRENT_LIST_DIR}/testdata.c)
target_include_directories(epd_testlib PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(epd_testlib PUBLIC epd_common m)

if(CHECK_FOUND)
  add_executable(unit_plan ${CMAKE_CURRENT_LIST_DIR}/unit_plan.c)
  target_link_libraries(unit_plan PRIVATE epd_testlib epd_common epd_check)
  add_test(NAME unit_plan COMMAND unit_plan)

  # host_exec.c is compiled into the test directly, so the test does not pull in the daemon's
  # libuv/systemd dependencies. -O3 as in the daemon: the test then exercises the vectorised loops
  # that production runs.
  add_executable(unit_host_exec ${CMAKE_CURRENT_LIST_DIR}/unit_host_exec.c
    ${EPD_ROOT_DIR}/daemon/host_exec.c)
  set_source_files_properties(${EPD_ROOT_DIR}/daemon/host_exec.c PROPERTIES COMPILE_OPTIONS "-O3")
  target_include_directories(unit_host_exec PRIVATE ${EPD_ROOT_DIR}/daemon)
  target_link_libraries(unit_host_exec PRIVATE epd_testlib epd_common epd_check
    Threads::Threads)
  add_test(NAME unit_host_exec COMMAND unit_host_exec)
  set_tests_properties(unit_plan unit_host_exec PROPERTIES TIMEOUT 600)

  # Framing needs only epd_common; config, registry, arena and stats come from the daemon
  # library (which pulls libuv, inih and libsystemd in, unused by these tests).
  add_executable(unit_frame ${CMAKE_CURRENT_LIST_DIR}/unit_frame.c)
  target_link_libraries(unit_frame PRIVATE epd_common epd_check)
  add_test(NAME unit_frame COMMAND unit_frame)

  add_executable(unit_config ${CMAKE_CURRENT_LIST_DIR}/unit_config.c)
  target_link_libraries(unit_config PRIVATE epd_daemon epd_check)
  add_test(NAME unit_config COMMAND unit_config)

  add_executable(unit_registry ${CMAKE_CURRENT_LIST_DIR}/unit_registry.c)
  target_link_libraries(unit_registry PRIVATE epd_daemon epd_check)
  add_test(NAME unit_registry COMMAND unit_registry)
  # The daemon's side of the reply mailbox, compiled in directly like host_exec.c.
  add_executable(unit_mailbox ${CMAKE_CURRENT_LIST_DIR}/unit_mailbox.c
    ${EPD_ROOT_DIR}/daemon/mailbox.c)
  target_include_directories(unit_mailbox PRIVATE ${EPD_ROOT_DIR}/daemon)
  target_link_libraries(unit_mailbox PRIVATE epd_common epd_check Threads::Threads)
  add_test(NAME unit_mailbox COMMAND unit_mailbox)
  # libepd against a fake daemon (a thread speaking the framing) that answers with the wrong
  # reply body.
  add_executable(unit_client ${CMAKE_CURRENT_LIST_DIR}/unit_client.c)
  target_link_libraries(unit_client PRIVATE epd_client_static epd_common epd_check
    Threads::Threads)
  add_test(NAME unit_client COMMAND unit_client)
  set_tests_properties(unit_frame unit_config unit_registry unit_mailbox unit_client
    PROPERTIES TIMEOUT 120)
else()
  message(STATUS "epd: Check not found, unit tests disabled")
endif()
