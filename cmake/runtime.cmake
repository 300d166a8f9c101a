# remat::runtime (on LibTorch and the planner library), remat::models (on the runtime), the remat::remat umbrella,
# and libremat_meter (the CPU meter alone, for Python processes).
find_package(Torch REQUIRED)
separate_arguments(REMAT_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")

# A CUDA build of LibTorch brings c10_cuda; only then is the CUDA memory meter compiled in.
if(TARGET c10_cuda OR C10_CUDA_LIBRARY)
  set(REMAT_WITH_CUDA ON)
else()
  set(REMAT_WITH_CUDA OFF)
endif()
message(STATUS "remat: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}, CUDA meter: ${REMAT_WITH_CUDA}")

# ---------------------------------------------------------------------------------------------------------------
# The runtime
set(REMAT_RUNTIME_SOURCES
  # autograd mechanics: remat's engine, saved-tensor hook sources, per-thread state, nesting, the dispatcher
  src/runtime/autograd/engine.cpp
  src/runtime/autograd/hooks.cpp
  src/runtime/autograd/thread_state.cpp
  src/runtime/autograd/nesting.cpp
  src/runtime/autograd/watch.cpp
  src/runtime/autograd/saved.cpp
  # checkpointing: the two modes and what their recomputes share
  src/runtime/checkpoint/checkpoint.cpp
  src/runtime/checkpoint/non_reentrant.cpp
  src/runtime/checkpoint/reentrant.cpp
  src/runtime/checkpoint/region.cpp
  src/runtime/checkpoint/kept.cpp
  src/runtime/checkpoint/restore.cpp
  # policies: what each operator call's saved tensors become
  src/runtime/policy/policy.cpp
  src/runtime/policy/op_policy.cpp
  # memory: the meters and measuring
  src/runtime/memory/memory.cpp
  src/runtime/memory/cpu_meter.cpp
  src/runtime/memory/peak_window.cpp
  src/runtime/memory/measure.cpp
  # planning in place: profiling, the plan executor, checkpoint_sequential, remat::Planned
  src/runtime/planning/profile.cpp
  src/runtime/planning/saved_groups.cpp
  src/runtime/planning/executor.cpp
  src/runtime/planning/sequential.cpp
  src/runtime/planning/planned.cpp
  src/runtime/planning/out_of_memory.cpp
  # offloading to host memory
  src/runtime/offload/offload.cpp
  src/runtime/offload/stage_offload.cpp
)
# Data parallel (remat/distributed.h) needs c10d's ProcessGroupGloo header, which includes gloo's headers:
# libgloo-dev (scripts/setup installs it; LibTorch links gloo in, the headers are only for the declarations).
find_path(REMAT_GLOO_INCLUDE_DIR gloo/config.h)
find_path(REMAT_C10D_INCLUDE_DIR torch/csrc/distributed/c10d/ProcessGroupGloo.hpp PATHS ${TORCH_INCLUDE_DIRS}
          NO_DEFAULT_PATH)
if(REMAT_GLOO_INCLUDE_DIR AND REMAT_C10D_INCLUDE_DIR)
  set(REMAT_HAS_DISTRIBUTED 1)
else()
  set(REMAT_HAS_DISTRIBUTED 0)
  message(WARNING "remat: no gloo headers (libgloo-dev) or no c10d in this LibTorch: remat/distributed.h "
                  "is left out (scripts/setup installs libgloo-dev)")
endif()
message(STATUS "remat: data parallel (c10d + Gloo): ${REMAT_HAS_DISTRIBUTED}")

add_library(remat_runtime ${REMAT_RUNTIME_SOURCES})
add_library(remat::runtime ALIAS remat_runtime)
set_target_properties(remat_runtime PROPERTIES EXPORT_NAME runtime)
target_include_directories(remat_runtime PRIVATE ${PROJECT_SOURCE_DIR}/src/runtime)
target_link_libraries(remat_runtime PUBLIC remat_planner)
# Torch's usage requirements: at build time from the Torch found above; for an installed remat, rematConfig.cmake
# adds those of the Torch the application finds, so the package follows the application's LibTorch.
target_include_directories(remat_runtime SYSTEM PUBLIC $<BUILD_INTERFACE:${TORCH_INCLUDE_DIRS}>)
target_link_libraries(remat_runtime PUBLIC $<BUILD_INTERFACE:${TORCH_LIBRARIES}>)
target_compile_options(remat_runtime PUBLIC $<BUILD_INTERFACE:${REMAT_TORCH_CXX_FLAGS}>)
# PyPI's torch wheel finds its NVIDIA libraries (NCCL, cuDNN, ...) through its own RPATH, in the nvidia/
# packages beside it. The linker must look there first, before the CUDA toolkit's older copies of the same
# sonames (NCCL's especially), or libtorch_cuda's newer symbols are missing at link time.
file(GLOB REMAT_TORCH_NVIDIA_LIBS "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
if(REMAT_TORCH_NVIDIA_LIBS)
  list(JOIN REMAT_TORCH_NVIDIA_LIBS ":" _remat_rpath_link)
  target_link_options(remat_runtime INTERFACE $<BUILD_INTERFACE:LINKER:-rpath-link,${_remat_rpath_link}>)
endif()
target_compile_options(remat_runtime PRIVATE -Wall -Wextra)
if(REMAT_WITH_CUDA)
  # Only the meter's sources: a target-wide definition would make the precompiled header, which the tests,
  # tools and examples reuse, differ from theirs (and GCC would silently not use it).
  target_sources(remat_runtime PRIVATE src/runtime/memory/cuda_meter.cpp)
  set_source_files_properties(src/runtime/memory/memory.cpp src/runtime/memory/cuda_meter.cpp PROPERTIES
                              COMPILE_DEFINITIONS REMAT_WITH_CUDA=1 SKIP_PRECOMPILE_HEADERS ON)
endif()
if(REMAT_USE_PCH)
  target_precompile_headers(remat_runtime PRIVATE src/runtime/detail/pch.h)
endif()

# Targets that compile against LibTorch reuse the runtime's precompiled header: REMAT_REUSE_PCH(target).
function(remat_reuse_pch target)
  if(REMAT_USE_PCH)
    # The precompiled header is the runtime's (-fPIC): compile the same way to reuse it.
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${target} PRIVATE -fPIC)
    target_precompile_headers(${target} REUSE_FROM remat_runtime)
  endif()
endfunction()

# ---------------------------------------------------------------------------------------------------------------
# Data parallel (remat/distributed.h), a target of its own: remat::distributed, on the runtime (its nesting and
# profiler flags) and c10d; never on the planner or the models. remat::remat brings it where it is built.
if(REMAT_HAS_DISTRIBUTED)
  add_library(remat_distributed src/runtime/distributed/process_group.cpp
                                src/runtime/distributed/data_parallel.cpp src/runtime/distributed/launch.cpp)
  add_library(remat::distributed ALIAS remat_distributed)
  set_target_properties(remat_distributed PROPERTIES EXPORT_NAME distributed)
  target_include_directories(remat_distributed PRIVATE ${PROJECT_SOURCE_DIR}/src/runtime)
  target_link_libraries(remat_distributed PUBLIC remat_runtime)
  target_compile_options(remat_distributed PRIVATE -Wall -Wextra)
  if(NOT REMAT_GLOO_INCLUDE_DIR STREQUAL "/usr/include")
    set_source_files_properties(src/runtime/distributed/process_group.cpp PROPERTIES INCLUDE_DIRECTORIES
                                "${REMAT_GLOO_INCLUDE_DIR}")
  endif()
  if(REMAT_USE_PCH)
    target_precompile_headers(remat_distributed REUSE_FROM remat_runtime)
  endif()
  # NCCL (InitOptions().backend("nccl")): c10d's ProcessGroupNCCL, in a CUDA LibTorch whose headers carry it, with
  # nccl.h: PyPI's torch wheel has both (nccl.h in the nvidia-nccl package beside it); or libnccl-dev's. Its
  # header declares the class only under USE_C10D_NCCL, which LibTorch's own build defines: nccl.cpp alone gets it.
  set(REMAT_HAS_NCCL 0)
  if(REMAT_WITH_CUDA)
    find_path(REMAT_C10D_NCCL_INCLUDE_DIR torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp PATHS ${TORCH_INCLUDE_DIRS}
              NO_DEFAULT_PATH)
    find_path(REMAT_NCCL_INCLUDE_DIR nccl.h HINTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include")
    if(REMAT_C10D_NCCL_INCLUDE_DIR AND REMAT_NCCL_INCLUDE_DIR)
      set(REMAT_HAS_NCCL 1)
      target_sources(remat_distributed PRIVATE src/runtime/distributed/nccl.cpp)
      set_source_files_properties(src/runtime/distributed/nccl.cpp PROPERTIES COMPILE_DEFINITIONS USE_C10D_NCCL=1
                                  INCLUDE_DIRECTORIES "${REMAT_NCCL_INCLUDE_DIR}" SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endif()
  set_property(SOURCE src/runtime/distributed/process_group.cpp APPEND PROPERTY
               COMPILE_DEFINITIONS REMAT_HAS_NCCL=${REMAT_HAS_NCCL})
  set_source_files_properties(src/runtime/distributed/process_group.cpp PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  message(STATUS "remat: data parallel on NCCL: ${REMAT_HAS_NCCL}")
endif()

# ---------------------------------------------------------------------------------------------------------------
# The reference models
add_library(remat_models
  src/models/bert.cpp
  src/models/cifar_net.cpp
  src/models/forum_cnn.cpp
  src/models/heavy_chain.cpp
  src/models/residual_mlp.cpp
  src/models/resnet.cpp
)
add_library(remat::models ALIAS remat_models)
set_target_properties(remat_models PROPERTIES EXPORT_NAME models)
target_link_libraries(remat_models PUBLIC remat_runtime)
target_compile_options(remat_models PRIVATE -Wall -Wextra)
if(REMAT_USE_PCH)
  target_precompile_headers(remat_models REUSE_FROM remat_runtime)
endif()

# ---------------------------------------------------------------------------------------------------------------
# The umbrella users have linked since the first release: the runtime (with the planner) and the models.
add_library(remat INTERFACE)
add_library(remat::remat ALIAS remat)
target_link_libraries(remat INTERFACE remat_runtime remat_models)
if(REMAT_HAS_DISTRIBUTED)
  target_link_libraries(remat INTERFACE remat_distributed)
endif()

# ---------------------------------------------------------------------------------------------------------------
# The CPU meter alone, with a C interface, for Python (ctypes) processes: it needs c10 only.
add_library(remat_meter SHARED src/runtime/memory/cpu_meter.cpp src/runtime/memory/peak_window.cpp
                               src/runtime/memory/meter_c.cpp)
target_include_directories(remat_meter PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src/runtime)
target_include_directories(remat_meter SYSTEM PRIVATE ${TORCH_INCLUDE_DIRS})
target_compile_options(remat_meter PRIVATE ${REMAT_TORCH_CXX_FLAGS} -Wall -Wextra)
target_compile_definitions(remat_meter PRIVATE REMAT_METER_C_LIBRARY=1)
target_link_libraries(remat_meter PRIVATE c10)
