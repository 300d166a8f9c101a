# What the consumer tests share (included by test_consumer.cmake and test_planner_only.cmake).

# step(COMMAND...): runs a command, or fails the test naming it.
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: '${ARGN}' failed (${rc})")
  endif()
endfunction()

# planner_consumer(PREFIX BUILD): builds examples/planner_consumer against the remat installed in PREFIX with
# Torch out of reach (find_package(Torch) disabled), checks that no compile line has a torch include path, and
# runs it.
function(planner_consumer prefix build)
  step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/planner_consumer" -B "${build}" -G Ninja
       -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON)
  step(${CMAKE_COMMAND} --build "${build}")
  file(READ "${build}/compile_commands.json" commands)
  string(TOLOWER "${commands}" commands)
  if(commands MATCHES "torch")
    message(FATAL_ERROR "consumer test: the planner consumer compiles with a torch path: ${commands}")
  endif()
  step("${build}/planner_consumer")
endfunction()
