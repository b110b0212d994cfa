# epd-soak: a long verified run that watches the daemon's RSS and fds (`make soak`). An
# executable only, not a CTest test. Included by integration.cmake (after integ_faults.cmake,
# which it shares the step engine with; either defines it).
if(NOT TARGET epd_randstep)
  add_library(epd_randstep STATIC ${CMAKE_CURRENT_LIST_DIR}/randstep.c)
  target_include_directories(epd_randstep PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(epd_randstep PUBLIC epd_testlib epd_client_static)
endif()
add_executable(epd-soak ${CMAKE_CURRENT_LIST_DIR}/soak.c)
target_include_directories(epd-soak PRIVATE ${CMAKE_CURRENT_LIST_DIR} ${CMAKE_SOURCE_DIR}/common)
target_link_libraries(epd-soak PRIVATE epd_randstep epd_harness)
add_dependencies(epd-soak epd epctl)
