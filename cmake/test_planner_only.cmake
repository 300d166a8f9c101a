# ctest: the planner library on a machine without LibTorch. Configures remat's source tree with
# REMAT_PLANNER_ONLY and Torch out of reach (find_package(Torch) disabled), builds it, runs its tests (the
# planner's GoogleTest binary), installs it, and builds and runs examples/planner_consumer against that install.
# Arguments: -DSOURCE_DIR=... -DWORK_DIR=... [-DPLANNER_BUILD_DIR=...] (the build tree; WORK_DIR/build unless
# given: tests/CMakeLists.txt says where and why)
include(${CMAKE_CURRENT_LIST_DIR}/consumer_steps.cmake)
if(NOT PLANNER_BUILD_DIR)
  set(PLANNER_BUILD_DIR "${WORK_DIR}/build")
endif()
file(REMOVE_RECURSE "${WORK_DIR}" "${PLANNER_BUILD_DIR}")
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${PLANNER_BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE=Release
     -DREMAT_PLANNER_ONLY=ON -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON)
step(${CMAKE_COMMAND} --build "${PLANNER_BUILD_DIR}")
step(${CMAKE_CTEST_COMMAND} --test-dir "${PLANNER_BUILD_DIR}" --output-on-failure)
step(${CMAKE_COMMAND} --install "${PLANNER_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
if(EXISTS "${WORK_DIR}/prefix/include/remat/checkpoint.h")
  message(FATAL_ERROR "planner-only test: the runtime's headers were installed without the runtime")
endif()
planner_consumer("${WORK_DIR}/prefix" "${WORK_DIR}/consumer")
