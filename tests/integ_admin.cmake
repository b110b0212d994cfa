# The admin verbs (epctl drain, undrain, evict) against the real daemon, and the Prometheus
# endpoint and `epctl top` under load. Included by tests/integration.cmake.
if(CHECK_FOUND)
  epd_integration_test(integ_admin ${CMAKE_CURRENT_LIST_DIR}/integ_admin.c)
  target_include_directories(integ_admin PRIVATE ${JANSSON_INCLUDE})
  target_link_libraries(integ_admin PRIVATE ${JANSSON_LIB})
endif()

# The Prometheus endpoint under load (label metrics; promtool installed on demand, else skipped)
# and `epctl top` in a tmux pane under load (label top; skipped without tmux).
add_executable(integ_metrics ${CMAKE_CURRENT_LIST_DIR}/integ_metrics.c)
target_link_libraries(integ_metrics PRIVATE epd_harness epd_workload)
add_dependencies(integ_metrics epd epctl)
add_test(NAME metrics_exposition COMMAND integ_metrics exposition)
add_test(NAME metrics_promtool COMMAND integ_metrics promtool)
add_test(NAME epctl_top COMMAND integ_metrics top)
set_tests_properties(metrics_exposition PROPERTIES LABELS "integration;metrics" TIMEOUT 120
  SKIP_RETURN_CODE 77)
# Installing prometheus for promtool may take a few minutes on a fresh machine.
set_tests_properties(metrics_promtool PROPERTIES LABELS "integration;metrics" TIMEOUT 600
  SKIP_RETURN_CODE 77)
set_tests_properties(epctl_top PROPERTIES LABELS "integration;top" TIMEOUT 120
  SKIP_RETURN_CODE 77)

# The revision that `epd --version` and epd_build_info report is the checkout's HEAD, taken at
# build time (skipped outside a git checkout).
add_test(NAME build_revision
  COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/check-revision.sh $<TARGET_FILE:epd> ${CMAKE_SOURCE_DIR})
set_tests_properties(build_revision PROPERTIES LABELS "admin" TIMEOUT 30 SKIP_RETURN_CODE 77)
