# libFuzzer targets (EPD_FUZZ=ON; clang, with EPD_SANITIZE=ON so that every target of the build
# has ASan/UBSan). `make fuzz-smoke` configures build-fuzz this way, runs each target for a
# bounded time on its seed corpus, and replays the committed corpus and regression inputs with
# CTest. Paths are taken from this file's location.
#
#   fuzz_frame    the frame header check and epd_frame_recv with fds (common/frame.c)
#   fuzz_request  every request handler through real connections of a daemon with the host
#                 backend (daemon/conn.c, handlers.c, group.c, registry.c, op.c, ...)
#   fuzz_config   the configuration file parser and epd_config_set (daemon/config.c)
#
# Seeds live in corpus/<target>/ (written by gen_corpus: `cmake --build build-fuzz --target
# fuzz-corpus`), inputs that once crashed a target in regressions/<target>/.
if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "EPD_FUZZ=ON needs clang (libFuzzer): configure with -DCMAKE_C_COMPILER=clang")
endif()
if(NOT EPD_SANITIZE AND NOT EPD_TSAN)
  message(FATAL_ERROR "EPD_FUZZ=ON needs EPD_SANITIZE=ON (or EPD_TSAN=ON to replay inputs under ThreadSanitizer): every object of a fuzz target must be built with a sanitizer")
endif()

set(EPD_FUZZ_DIR ${CMAKE_CURRENT_LIST_DIR})

# Coverage feedback from the code under test: the libraries get the fuzzer's instrumentation
# without its main().
foreach(lib epd_common epd_daemon)
  target_compile_options(${lib} PRIVATE $<$<COMPILE_LANGUAGE:C>:-fsanitize=fuzzer-no-link>)
endforeach()

function(epd_fuzz_target name)
  add_executable(${name} ${EPD_FUZZ_DIR}/${name}.c)
  target_include_directories(${name} PRIVATE ${EPD_FUZZ_DIR})
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  target_link_libraries(${name} PRIVATE ${ARGN})
  # Replays the seeds and every past crash once; -runs=0 only runs the given inputs.
  set(dirs ${EPD_FUZZ_DIR}/corpus/${name})
  if(EXISTS ${EPD_FUZZ_DIR}/regressions/${name})
    list(APPEND dirs ${EPD_FUZZ_DIR}/regressions/${name})
  endif()
  add_test(NAME ${name}_replay COMMAND ${name} -runs=0 ${dirs})
  set_tests_properties(${name}_replay PROPERTIES TIMEOUT 300 LABELS fuzz)
endfunction()

epd_fuzz_target(fuzz_frame epd_common)
epd_fuzz_target(fuzz_request epd_daemon)
epd_fuzz_target(fuzz_config epd_daemon)

# The seed generator is a plain program; its output is committed.
add_executable(fuzz_gen_corpus ${EPD_FUZZ_DIR}/gen_corpus.c)
target_include_directories(fuzz_gen_corpus PRIVATE ${EPD_FUZZ_DIR})
target_link_libraries(fuzz_gen_corpus PRIVATE epd_common)
add_custom_target(fuzz-corpus
  COMMAND fuzz_gen_corpus ${EPD_FUZZ_DIR}/corpus
  DEPENDS fuzz_gen_corpus
  COMMENT "Writing the fuzz seed corpus to ${EPD_FUZZ_DIR}/corpus")
