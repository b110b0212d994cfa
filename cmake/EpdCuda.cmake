# EpdCuda.cmake - helpers for targets with CUDA sources, included by the top-level CMakeLists.txt.
#
# The top level's add_compile_options are gcc flags (-Wall, -ffp-contract=off, ...) that nvcc
# rejects. epd_cuda_filter_options keeps them for a target's C sources, hides them from nvcc, and
# leaves warnings to nvcc's host compiler. epd_cuda_target does that and sets what every CUDA
# target of the project shares: C++17 and the static CUDA runtime (binaries built on a machine
# with the toolkit run on GPU hosts that have only the driver).
function(epd_cuda_filter_options target)
  get_target_property(opts ${target} COMPILE_OPTIONS)
  if(NOT opts)
    return()
  endif()
  set(filtered "")
  foreach(opt IN LISTS opts)
    list(APPEND filtered "$<$<NOT:$<COMPILE_LANGUAGE:CUDA>>:${opt}>")
  endforeach()
  set_property(TARGET ${target} PROPERTY COMPILE_OPTIONS "${filtered}")
endfunction()

# SEMANTICS (docs/semantics.md section 3): no fused multiply-add, no flush-to-zero, IEEE division
# and square root, for every CUDA source that computes what the contract fixes bit for bit.
# -lineinfo lets ncu and compute-sanitizer name source lines without slowing the code.
set(EPD_CUDA_FLAGS --fmad=false -ftz=false -prec-div=true -prec-sqrt=true -lineinfo
    -Xcompiler=-Wall,-Wextra)

# C++17 and the static runtime, without EPD_CUDA_FLAGS (the probes of bench/probes/).
function(epd_cuda_binary target)
  epd_cuda_filter_options(${target})
  set_target_properties(${target} PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Static)
  target_link_libraries(${target} PRIVATE CUDA::cudart_static)
endfunction()

function(epd_cuda_target target)
  epd_cuda_binary(${target})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${EPD_CUDA_FLAGS}>)
endfunction()
