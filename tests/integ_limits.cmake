# Configured limits: each exceeded limit gives a clear status or closes the offending connection,
# and the daemon keeps serving other clients. Included by integration.cmake.
if(CHECK_FOUND)
  epd_integration_test(integ_limits ${CMAKE_CURRENT_LIST_DIR}/integ_limits.c)
  target_include_directories(integ_limits PRIVATE ${JANSSON_INCLUDE})
  target_link_libraries(integ_limits PRIVATE ${JANSSON_LIB})
endif()
