# Protocol and failure-handling integration tests: the real daemon, real client processes and
# hand-built raw frames. Included by integration.cmake; epctl's --json output is parsed with
# jansson.
if(CHECK_FOUND)
  epd_integration_test(integ_proto ${CMAKE_CURRENT_LIST_DIR}/integ_proto.c)
  target_include_directories(integ_proto PRIVATE ${JANSSON_INCLUDE})
  target_link_libraries(integ_proto PRIVATE ${JANSSON_LIB})
endif()
