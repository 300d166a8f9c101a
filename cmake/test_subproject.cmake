# ctest: build examples/subproject, which adds remat with add_subdirectory, and run it; then configure it
# again with Torch found by the application first (the other order users write).
# Arguments: -DSOURCE_DIR=... -DWORK_DIR=... [-DTORCH_DIR=...]
include(${CMAKE_CURRENT_LIST_DIR}/consumer_steps.cmake)
file(REMOVE_RECURSE "${WORK_DIR}")
# The LibTorch remat was built with, found before any other on the machine: Torch's package directory and the
# Caffe2 package beside it (which Torch loads, and would otherwise find in the system's directories first).
set(torch_hints "")
if(TORCH_DIR)
  get_filename_component(caffe2_dir "${TORCH_DIR}/../Caffe2" ABSOLUTE)
  set(torch_hints "-DTorch_DIR=${TORCH_DIR}" "-DCaffe2_DIR=${caffe2_dir}")
endif()
# Built without optimization: what is tested is how remat joins another project's build (its targets, options
# and Torch found in either order), and remat compiled again at -O3 was the longest test on a fresh machine.
# And as a unity build (CMAKE_UNITY_BUILD, which an application may set for its whole tree): remat's sources
# compile so too (two files' constants of the same name in one namespace did not, until 2026-12-02), in 12
# compile steps instead of 55 (cold, 2 cores: 77 s against 175 s).
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/subproject" -B "${WORK_DIR}/remat-first" -G Ninja
     -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" -DCMAKE_UNITY_BUILD=ON
     "-DREMAT_SOURCE_DIR=${SOURCE_DIR}" ${torch_hints})
step(${CMAKE_COMMAND} --build "${WORK_DIR}/remat-first")
step("${WORK_DIR}/remat-first/app")
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/subproject" -B "${WORK_DIR}/torch-first" -G Ninja
     -DCMAKE_BUILD_TYPE=Release "-DREMAT_SOURCE_DIR=${SOURCE_DIR}" -DFIND_TORCH_FIRST=ON ${torch_hints})
