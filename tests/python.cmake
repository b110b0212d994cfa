# The Python binding (client/python/epd) and examples/moe_worker.py: a unittest suite against a
# real host-backend daemon. It loads the libepd.so of this build (EPD_LIBRARY) and starts the
# epd of this build (found on PATH). Label `python`; skipped (exit 77) without NumPy.
#
# The interpreter: the first of `python3` on PATH and /usr/bin/python3 that can import NumPy
# (Debian's python3-numpy belongs to /usr/bin/python3; a pyenv or virtualenv python3 first on
# PATH may lack it). Override with -DEPD_PYTHON=/path/to/python3.
if(NOT TARGET epd_client)
  # The static-dependency build has no libepd.so for ctypes to load.
  return()
endif()

if(NOT EPD_PYTHON)
  find_program(EPD_PYTHON_ON_PATH NAMES python3)
  set(_epd_python_candidates ${EPD_PYTHON_ON_PATH} /usr/bin/python3)
  set(_epd_python "")
  foreach(_candidate IN LISTS _epd_python_candidates)
    if(_candidate AND EXISTS "${_candidate}")
      if(NOT _epd_python)
        set(_epd_python "${_candidate}") # the fallback: the test then skips
      endif()
      execute_process(COMMAND "${_candidate}" -c "import numpy"
                      RESULT_VARIABLE _epd_numpy_rc OUTPUT_QUIET ERROR_QUIET)
      if(_epd_numpy_rc EQUAL 0)
        set(_epd_python "${_candidate}")
        break()
      endif()
    endif()
  endforeach()
  if(_epd_python)
    set(EPD_PYTHON "${_epd_python}" CACHE FILEPATH "Python 3 interpreter for the binding's tests"
        FORCE)
  endif()
endif()

if(EPD_PYTHON)
  # Where the tests find the epd daemon binary of this build.
  set(EPD_PYTHON_TEST_BIN_DIR ${CMAKE_RUNTIME_OUTPUT_DIRECTORY})
  set(_epd_python_env
    "EPD_LIBRARY=$<TARGET_FILE:epd_client>"
    "PATH=${EPD_PYTHON_TEST_BIN_DIR}:$ENV{PATH}"
    "PYTHONDONTWRITEBYTECODE=1")
  if(EPD_SANITIZE)
    # An ASan-built libepd.so can only be loaded into an uninstrumented python3 when the ASan
    # runtime comes first; Python's own allocations are not ours to leak-check.
    execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libasan.so
                    OUTPUT_VARIABLE _epd_libasan OUTPUT_STRIP_TRAILING_WHITESPACE)
    list(APPEND _epd_python_env "LD_PRELOAD=${_epd_libasan}"
      "ASAN_OPTIONS=detect_leaks=0")
  endif()
  add_test(NAME python_binding
           COMMAND ${EPD_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/python/run.py)
  set_tests_properties(python_binding PROPERTIES
    LABELS "python"
    ENVIRONMENT "${_epd_python_env}"
    SKIP_RETURN_CODE 77
    TIMEOUT 600)
endif()
