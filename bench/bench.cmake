# epd-bench, included by the top-level CMakeLists.txt after add_subdirectory(tests), because the
# benchmark links two test libraries: the seeded data generators and the independent reference
# (epd_testlib), with which it verifies its first iteration bitwise, and the integration harness
# (epd_harness), with which it starts its own daemon. Paths are taken from this file's location.
add_executable(epd-bench ${CMAKE_CURRENT_LIST_DIR}/epd_bench.c ${CMAKE_CURRENT_LIST_DIR}/mps_state.c)
target_include_directories(epd-bench PRIVATE ${JANSSON_INCLUDE} ${CMAKE_CURRENT_LIST_DIR}/../tests)
target_link_libraries(epd-bench PRIVATE epd_client_static epd_testlib epd_harness ${JANSSON_LIB}
  Threads::Threads m)
# With CUDA, --backend cuda: workers with device memory, the device-to-device copy ceiling and
# stream-ordered completion. Static cudart, as in libepd: the binary needs only the driver on a
# GPU host and starts (and fails cleanly in CUDA mode) on a machine without one.
if(EPD_HAVE_CUDA)
  # p2p_store.cu: the peer-to-peer store ceiling of --devices N >= 2 (a kernel, so nvcc). The top
  # level enabled CUDA and set CMAKE_CUDA_ARCHITECTURES (sm_90 code plus PTX) for every target;
  # its gcc flags stay on epd_bench.c and are hidden from nvcc as in kernels/ (whose
  # epd_cuda_filter_options is defined before this file is included).
  target_sources(epd-bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/p2p_store.cu)
  epd_cuda_filter_options(epd-bench)
  target_compile_options(epd-bench PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo -Xcompiler=-Wall,-Wextra>)
  set_target_properties(epd-bench PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Static)
  target_compile_definitions(epd-bench PRIVATE EPD_BENCH_CUDA=1)
  target_include_directories(epd-bench PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(epd-bench PRIVATE CUDA::cudart_static)
endif()
# Without --socket the benchmark starts build/bin/epd next to itself.
add_dependencies(epd-bench epd)
if(EPD_HAVE_CUDA)
  # A GPU probe: C++17 CUDA, the static runtime, the bench directory's headers
  # (probe_check.cuh).
  function(epd_add_cuda_probe target)
    add_executable(${target} ${ARGN})
    target_include_directories(${target} PRIVATE ${CMAKE_CURRENT_FUNCTION_LIST_DIR})
    epd_cuda_filter_options(${target})
    set_target_properties(${target} PROPERTIES
      CUDA_STANDARD 17
      CUDA_STANDARD_REQUIRED ON
      CUDA_RUNTIME_LIBRARY Static)
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  endfunction()

  # epd-memop-probe: the GPU cost of the stream memory operations (doorbell writes and waits)
  # the daemon queues around an op, one call each against one cuStreamBatchMemOp.
  epd_add_cuda_probe(epd-memop-probe ${CMAKE_CURRENT_LIST_DIR}/memop_probe.cu
    ${CMAKE_CURRENT_LIST_DIR}/../common/cudrv.c)
  target_include_directories(epd-memop-probe PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../common
    ${CUDAToolkit_INCLUDE_DIRS})

  # epd-touch-probe: one thread's first loads after the benchmark's L2 flush, each timed: a
  # page's first touch, another line of it, an L2 hit (what a combine's first workspace loads
  # wait for).
  epd_add_cuda_probe(epd-touch-probe ${CMAKE_CURRENT_LIST_DIR}/touch_probe.cu)

  # epd-param-probe: what the start of a kernel costs after the benchmark's L2 flush and warm:
  # its first reads of its own parameters, by how many 64-byte lines of the block they touch and
  # whether they are constant-bank, dependent, generic or divergent reads; the event-timed launch
  # window by parameter bytes and grid shape; a warp's first pass through 1-32 KiB of code.
  epd_add_cuda_probe(epd-param-probe ${CMAKE_CURRENT_LIST_DIR}/param_probe.cu)

  # epd-floor-probe: the decode workload's bytes with the routing known in advance (empty,
  # store, copy, memset, reduce and stream kernels, and epd's own combine kernel on the same
  # data), in Fresh, clean and warm L2 states: the floors against which docs/performance.md
  # sets the decode targets. Same data as epd-bench (epd_testlib's generators).
  epd_add_cuda_probe(epd-floor-probe ${CMAKE_CURRENT_LIST_DIR}/floor_probe.cu
    ${CMAKE_CURRENT_LIST_DIR}/mps_state.c)
  target_include_directories(epd-floor-probe PRIVATE ${JANSSON_INCLUDE}
    ${CMAKE_CURRENT_LIST_DIR}/../kernels ${CMAKE_CURRENT_LIST_DIR}/../tests
    ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_options(epd-floor-probe PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo -Xcompiler=-Wall,-Wextra>)
  target_link_libraries(epd-floor-probe PRIVATE epd_kernels epd_testlib ${JANSSON_LIB})
endif()
