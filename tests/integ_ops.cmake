# Dispatch/combine end to end on the host backend, checked against the reference.
add_library(epd_workload STATIC ${CMAKE_CURRENT_SOURCE_DIR}/workload.c)
target_include_directories(epd_workload PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(epd_workload PUBLIC epd_testlib epd_client_static)

epd_integration_test(integ_ops ${CMAKE_CURRENT_SOURCE_DIR}/integ_ops.c)
target_link_libraries(integ_ops PRIVATE epd_workload)
epd_integration_test(integ_errors ${CMAKE_CURRENT_SOURCE_DIR}/integ_errors.c)
target_link_libraries(integ_errors PRIVATE epd_workload)
epd_integration_test(integ_doorbell ${CMAKE_CURRENT_SOURCE_DIR}/integ_doorbell.c)
target_link_libraries(integ_doorbell PRIVATE epd_workload)
# test_mailbox_second_refused plays a client that breaks libepd's one-reply-in-the-page rule.
target_include_directories(integ_doorbell PRIVATE ${CMAKE_SOURCE_DIR}/client)
