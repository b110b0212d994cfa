# Tests of the benchmark helpers under bench/ (label `bench`): bench/pm_timeline.py, which prints
# bench/profile-h200.sh's PM-sampling timelines, against a synthetic Nsight Compute export.
# python3 is one of the packages scripts/setup-deps.sh installs. Included by tests/CMakeLists.txt.
find_program(EPD_BENCH_PYTHON NAMES python3 REQUIRED)
get_filename_component(EPD_BENCH_DIR ${CMAKE_CURRENT_LIST_DIR}/../bench ABSOLUTE)
add_test(NAME bench_pm_timeline
  COMMAND ${EPD_BENCH_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_pm_timeline.py
          ${EPD_BENCH_DIR}/pm_timeline.py)
set_tests_properties(bench_pm_timeline PROPERTIES LABELS "bench" TIMEOUT 60)
