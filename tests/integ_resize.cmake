# `epctl resize`: growing and shrinking a group's output arenas under load, against the real
# daemon with real worker processes. Included by tests/integration.cmake (after integ_ops.cmake,
# which defines epd_workload); epctl's --json output is parsed with jansson.
if(CHECK_FOUND)
  epd_integration_test(integ_resize ${CMAKE_CURRENT_LIST_DIR}/integ_resize.c)
  target_include_directories(integ_resize PRIVATE ${JANSSON_INCLUDE})
  target_link_libraries(integ_resize PRIVATE epd_workload ${JANSSON_LIB})
  set_tests_properties(integ_resize PROPERTIES TIMEOUT 300)
endif()
