# Extra link libraries of epd-bench, which the top-level CMakeLists.txt creates when
# bench/epd_bench.c exists. The benchmark uses the seeded data generators and the independent
# reference (epd_testlib) to verify its first iteration bitwise, and the integration harness
# (epd_harness) to start its own daemon. Both libraries are defined under tests/; the top level
# includes this file after add_executable(epd-bench), and CMake resolves the target names at
# generation time, so it does not matter that tests/ is added later.
if(TARGET epd-bench)
  target_link_libraries(epd-bench PRIVATE epd_testlib epd_harness Threads::Threads m)
  # Without --socket the benchmark starts build/bin/epd next to itself.
  add_dependencies(epd-bench epd)
endif()
