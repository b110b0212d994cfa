# Access control: socket mode, uid/gid allow lists, admin rights, group secrets across users.
# Included by integration.cmake; the tests drop to `nobody` in child processes (root needed).
if(CHECK_FOUND)
  epd_integration_test(integ_auth ${CMAKE_CURRENT_LIST_DIR}/integ_auth.c)
  target_include_directories(integ_auth PRIVATE ${JANSSON_INCLUDE})
  target_link_libraries(integ_auth PRIVATE ${JANSSON_LIB})
endif()
