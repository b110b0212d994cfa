# client_cuda.cmake - libepd's device-memory registration (client/cuda.c), built only with CUDA.
# Included from the top-level CMakeLists.txt after epd_client_static is defined. It configures
# epd_client_static now and the shared epd_client whether it is defined before or after this
# file is included (a deferred call covers the latter).
#
# Static cudart, as in the daemon: a binary built on a machine with the toolkit runs on a GPU
# host that has only the driver. The driver API (cuMem*, pointer attributes) is resolved at run
# time (common/cudrv.h), so libepd users start on machines without a driver.
if(EPD_HAVE_CUDA)
  set(EPD_CLIENT_CUDA_SOURCE ${CMAKE_CURRENT_LIST_DIR}/cuda.c)

  function(epd_client_add_cuda target)
    get_target_property(done ${target} EPD_CLIENT_CUDA_ADDED)
    if(done)
      return()
    endif()
    set_target_properties(${target} PROPERTIES EPD_CLIENT_CUDA_ADDED ON)
    target_sources(${target} PRIVATE ${EPD_CLIENT_CUDA_SOURCE})
    target_compile_definitions(${target} PRIVATE EPD_HAVE_CUDA=1)
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  endfunction()

  function(epd_client_add_cuda_shared)
    if(TARGET epd_client)
      epd_client_add_cuda(epd_client)
    endif()
  endfunction()

  epd_client_add_cuda(epd_client_static)
  if(TARGET epd_client)
    epd_client_add_cuda(epd_client)
  else()
    cmake_language(DEFER CALL epd_client_add_cuda_shared)
  endif()
endif()
