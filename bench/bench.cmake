# epd-bench, included by the top-level CMakeLists.txt after add_subdirectory(tests), because the
# benchmark links two test libraries: the seeded data generators and the independent reference
# (epd_testlib), with which it verifies its first iteration bitwise, and the integration harness
# (epd_harness), with which it starts its own daemon. Paths are taken from this file's location.
add_executable(epd-bench ${CMAKE_CURRENT_LIST_DIR}/epd_bench.c)
target_include_directories(epd-bench PRIVATE ${JANSSON_INCLUDE} ${CMAKE_CURRENT_LIST_DIR}/../tests)
target_link_libraries(epd-bench PRIVATE epd_client_static epd_testlib epd_harness ${JANSSON_LIB}
  Threads::Threads m)
# With CUDA, --backend cuda: workers with device memory, the device-to-device copy ceiling and
# stream-ordered completion. Static cudart, as in libepd: the binary needs only the driver on a
# GPU host and starts (and fails cleanly in CUDA mode) on a machine without one.
if(EPD_HAVE_CUDA)
  target_compile_definitions(epd-bench PRIVATE EPD_BENCH_CUDA=1)
  target_include_directories(epd-bench PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(epd-bench PRIVATE CUDA::cudart_static)
endif()
# Without --socket the benchmark starts build/bin/epd next to itself.
add_dependencies(epd-bench epd)
