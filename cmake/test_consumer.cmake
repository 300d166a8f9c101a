# ctest: install remat from BUILD_DIR into a fresh prefix, build examples/consumer against it (a program on the
# umbrella remat::remat, one on remat::runtime alone) and examples/planner_consumer (remat::planner alone, Torch
# out of reach), and run them.
# Arguments: -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... [-DTORCH_DIR=...] (the LibTorch remat was built with)
include(${CMAKE_CURRENT_LIST_DIR}/consumer_steps.cmake)
file(REMOVE_RECURSE "${WORK_DIR}")
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# The LibTorch remat was built with, found before any other on the machine: Torch's package directory and the
# Caffe2 package beside it (which Torch loads, and would otherwise find in the system's directories first).
set(torch_hints "")
if(TORCH_DIR)
  get_filename_component(caffe2_dir "${TORCH_DIR}/../Caffe2" ABSOLUTE)
  set(torch_hints "-DTorch_DIR=${TORCH_DIR}" "-DCaffe2_DIR=${caffe2_dir}")
endif()
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/consumer" -B "${WORK_DIR}/build" -G Ninja
     -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" ${torch_hints})
step(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
step("${WORK_DIR}/build/consumer")
step("${WORK_DIR}/build/consumer_runtime")
if(EXISTS "${BUILD_DIR}/libremat_distributed.a" OR EXISTS "${BUILD_DIR}/libremat_distributed.so")
  step("${WORK_DIR}/build/consumer_distributed")
endif()
planner_consumer("${WORK_DIR}/prefix" "${WORK_DIR}/planner")
