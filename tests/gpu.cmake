# GPU tests: built only when CUDA is found, labelled `gpu`, and skipped (exit 77) where no GPU is
# usable, so `ctest -LE gpu` on a CPU-only machine and `ctest -L gpu` on a GPU host both work.
# tests/gpu/run-gpu-tests.sh runs the same binaries from a build directory copied to a GPU host,
# where CTest's absolute paths no longer hold.
if(EPD_HAVE_CUDA)
  # The kernels against the host backend, bit for bit. plan.c and host_exec.c are compiled in
  # directly (not through epd_common/epd_daemon) so that the binary needs nothing but the driver
  # on the GPU host: no protobuf-c, libuv or systemd libraries.
  add_executable(gpu_kernels_test
    ${CMAKE_CURRENT_SOURCE_DIR}/gpu/gpu_kernels_test.cu
    ${PROJECT_SOURCE_DIR}/common/plan.c
    ${PROJECT_SOURCE_DIR}/daemon/host_exec.c)
  target_include_directories(gpu_kernels_test PRIVATE ${PROJECT_SOURCE_DIR}/daemon)
  target_link_libraries(gpu_kernels_test PRIVATE epd_kernels Threads::Threads)
  # The top level's gcc flags stay on the C sources (-ffp-contract=off matters for the
  # reference) and are hidden from nvcc (epd_cuda_filter_options comes from kernels/).
  epd_cuda_filter_options(gpu_kernels_test)
  target_compile_options(gpu_kernels_test PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false -ftz=false -lineinfo -Xcompiler=-Wall,-Wextra>
    $<$<COMPILE_LANGUAGE:C>:-O3>)
  set_target_properties(gpu_kernels_test PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Static)
  add_test(NAME gpu_kernels COMMAND gpu_kernels_test)
  set_tests_properties(gpu_kernels PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 1200)

  # The realistic decode case alone, in a fresh process: a launch limit (dynamic shared memory)
  # that an earlier case raised must not hide a launch that fails on its own, as the daemon
  # runs it.
  add_test(NAME gpu_kernels_decode_alone COMMAND gpu_kernels_test)
  set_tests_properties(gpu_kernels_decode_alone PROPERTIES LABELS gpu SKIP_RETURN_CODE 77
    TIMEOUT 300 ENVIRONMENT EPD_KTEST_MATCH=decode)

  set(EPD_GPU_TESTS "bin/gpu_kernels_test\nEPD_KTEST_MATCH=decode bin/gpu_kernels_test\n")

  # Client processes whose tensors live in their own GPU memory (epd_region_register_device)
  # against the real daemon with the CUDA backend, checked bitwise against the reference.
  # Needs libepd built with CUDA (client/client_cuda.cmake) and Check.
  if(CHECK_FOUND AND TARGET epd_workload)
    add_executable(gpu_integ ${CMAKE_CURRENT_SOURCE_DIR}/gpu/gpu_integ.c)
    target_include_directories(gpu_integ PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
    target_link_libraries(gpu_integ PRIVATE epd_workload epd_harness epd_check
      CUDA::cudart_static CUDA::cuda_driver)
    add_dependencies(gpu_integ epd epctl)
    # It links libcuda (cuMem, and libepd's CUDA code), so without a driver it cannot even load:
    # skip there before trying, as its own probe would.
    add_test(NAME gpu_integ
      COMMAND sh -c "ls /dev/nvidia[0-9]* >/dev/null 2>&1 || exit 77; exec \"$0\""
              $<TARGET_FILE:gpu_integ>)
    set_tests_properties(gpu_integ PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 900)
    string(APPEND EPD_GPU_TESTS "bin/gpu_integ\n")
  endif()

  # The host-memory integration matrix on the CUDA backend: memfd regions the GPUs reach through
  # cudaHostRegister, outputs compared bitwise with the reference. integ_ops has no GPU check of
  # its own, so the test skips where the host shows no NVIDIA device node.
  if(TARGET integ_ops)
    add_test(NAME integ_ops_cuda
      COMMAND sh -c "ls /dev/nvidia[0-9]* >/dev/null 2>&1 || exit 77; exec \"$0\""
              $<TARGET_FILE:integ_ops>)
    set_tests_properties(integ_ops_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 1200
      ENVIRONMENT EPD_TEST_BACKEND=cuda)
    string(APPEND EPD_GPU_TESTS "EPD_TEST_BACKEND=cuda bin/integ_ops\n")
  endif()

  # The runner and the list of GPU test binaries, relative to the build directory.
  configure_file(${CMAKE_CURRENT_SOURCE_DIR}/gpu/run-gpu-tests.sh
                 ${CMAKE_BINARY_DIR}/tests/gpu/run-gpu-tests.sh COPYONLY)
  file(WRITE ${CMAKE_BINARY_DIR}/tests/gpu/gpu-tests.list "${EPD_GPU_TESTS}")
endif()

# The runner itself, on a fake build directory (no GPU needed, so it runs everywhere): passes,
# failures, and a hung test killed after its per-test limit rather than hanging the run.
add_test(NAME gpu_runner
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/gpu/check-runner.sh
          ${CMAKE_CURRENT_SOURCE_DIR}/gpu/run-gpu-tests.sh)
set_tests_properties(gpu_runner PROPERTIES TIMEOUT 120)
