# The CUDA kernels (cuda/gpu, cuda/sm80, cuda/sm90) and their extension, jax_flash._native_cuda.
# Included from CMakeLists.txt once a CUDA compiler is found. The CUDA runtime is linked
# statically; the kernels are built as SASS for sm_80 (A100 and later) and sm_90a (H100/H200).
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

file(GLOB JF_CUDA_SOURCES CONFIGURE_DEPENDS
  "${CMAKE_CURRENT_SOURCE_DIR}/cuda/gpu/*.cu"
  "${CMAKE_CURRENT_SOURCE_DIR}/cuda/sm80/*.cu"
  "${CMAKE_CURRENT_SOURCE_DIR}/cuda/sm90/*.cu")
add_library(jax_flash_cuda_kernels STATIC ${JF_CUDA_SOURCES})
set_target_properties(jax_flash_cuda_kernels PROPERTIES CUDA_ARCHITECTURES OFF)
# A debug build recording the Hopper forward's phases (sm90/fwd_timeline.h: JF_FWD_TIMELINE is
# its level; sm_90a only); never released.
set(JAX_FLASH_CUDA_TIMELINE "OFF" CACHE STRING
  "Record the Hopper forward's timeline: OFF, TILES (the tiles' phases), BLOCKS (every block's too) or CHAIN (the tiles' and each block's S in and softmax done)")
set(JF_CUDA_GENCODE -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a)
if(JAX_FLASH_CUDA_TIMELINE STREQUAL "TILES")
  set(JF_TIMELINE_LEVEL 1)
elseif(JAX_FLASH_CUDA_TIMELINE STREQUAL "BLOCKS")
  set(JF_TIMELINE_LEVEL 2)
elseif(JAX_FLASH_CUDA_TIMELINE STREQUAL "CHAIN")
  set(JF_TIMELINE_LEVEL 3)
elseif(NOT JAX_FLASH_CUDA_TIMELINE STREQUAL "OFF")
  message(FATAL_ERROR "JAX_FLASH_CUDA_TIMELINE=${JAX_FLASH_CUDA_TIMELINE}: OFF, TILES, BLOCKS or CHAIN")
endif()
if(JF_TIMELINE_LEVEL)
  set(JF_CUDA_GENCODE -gencode=arch=compute_90a,code=sm_90a)
endif()
target_compile_options(jax_flash_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr -DNDEBUG ${JF_CUDA_GENCODE}>)
target_include_directories(jax_flash_cuda_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda)

nanobind_add_module(_native_cuda NB_STATIC cuda/gpu/module.cc cuda/gpu/ffi_handlers.cc
  cuda/gpu/decode_ffi_handlers.cc)
target_include_directories(_native_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda)
target_include_directories(_native_cuda SYSTEM PRIVATE ${XLA_FFI_INCLUDE_DIR})
target_compile_options(_native_cuda PRIVATE ${JF_CPU_WARNINGS})
target_link_libraries(_native_cuda PRIVATE jax_flash_cuda_kernels CUDA::cudart_static)
install(TARGETS _native_cuda LIBRARY DESTINATION jax_flash)

if(JF_TIMELINE_LEVEL)
  target_compile_definitions(jax_flash_cuda_kernels PRIVATE JF_FWD_TIMELINE=${JF_TIMELINE_LEVEL})
  target_compile_definitions(_native_cuda PRIVATE JF_FWD_TIMELINE=${JF_TIMELINE_LEVEL})
endif()
