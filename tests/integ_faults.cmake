# Fault injection: SIGKILLed ranks at random points of a busy group, on the real daemon. Included
# by integration.cmake. The step engine (randstep.c) is shared with the soak (soak.cmake).
if(NOT TARGET epd_randstep)
  add_library(epd_randstep STATIC ${CMAKE_CURRENT_LIST_DIR}/randstep.c)
  target_include_directories(epd_randstep PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(epd_randstep PUBLIC epd_testlib epd_client_static)
endif()
if(CHECK_FOUND)
  epd_integration_test(integ_faults ${CMAKE_CURRENT_LIST_DIR}/integ_faults.c)
  target_include_directories(integ_faults PRIVATE ${JANSSON_INCLUDE})
  target_link_libraries(integ_faults PRIVATE epd_randstep ${JANSSON_LIB})
  set_tests_properties(integ_faults PROPERTIES TIMEOUT 300)
endif()
