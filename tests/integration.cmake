# Integration tests: the real build/bin/epd and real client processes. The harness finds the
# binaries next to the test executable, so a copied build directory still works.
add_library(epd_harness STATIC ${CMAKE_CURRENT_SOURCE_DIR}/harness.c)
target_include_directories(epd_harness PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(epd_harness PUBLIC epd_client_static)
# The shared test helpers that assert with Check or parse epctl's JSON (harness.h, second half),
# apart so that tools built on epd_harness (epd-demo, epd-bench) need neither.
add_library(epd_harness_check STATIC ${CMAKE_CURRENT_SOURCE_DIR}/harness_check.c)
target_include_directories(epd_harness_check PUBLIC ${JANSSON_INCLUDE}
                           PRIVATE ${CMAKE_SOURCE_DIR}/common)
target_link_libraries(epd_harness_check PUBLIC epd_harness epd_check ${JANSSON_LIB})

# Each integration test binary depends on the daemon and epctl being built.
function(epd_integration_test name)
  add_executable(${name} ${ARGN})
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR} ${CMAKE_SOURCE_DIR}/common)
  target_link_libraries(${name} PRIVATE epd_harness epd_harness_check epd_check)
  add_dependencies(${name} epd epctl)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "integration" TIMEOUT 600)
endfunction()

include(${CMAKE_CURRENT_SOURCE_DIR}/integ_proto.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/integ_ops.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/integ_admin.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/integ_resize.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/integ_faults.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/integ_limits.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/integ_auth.cmake OPTIONAL)
include(${CMAKE_CURRENT_SOURCE_DIR}/soak.cmake OPTIONAL)
