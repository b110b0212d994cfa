# The Prometheus endpoint (daemon/metrics.c, libmicrohttpd) and the admin verbs (daemon/admin.c)
# of the daemon library. Included by the top-level CMakeLists.txt after epd_daemon is defined.
target_sources(epd_daemon PRIVATE ${CMAKE_CURRENT_LIST_DIR}/metrics.c
  ${CMAKE_CURRENT_LIST_DIR}/admin.c)
target_include_directories(epd_daemon PRIVATE ${MHD_INCLUDE})
target_link_libraries(epd_daemon PUBLIC ${MHD_LIB} ${EPD_MHD_EXTRA})
