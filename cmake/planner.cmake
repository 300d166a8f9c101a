# remat::planner: chains, plans, the planners, the strategy grammar, reports and their JSON. Plain C++17: no
# LibTorch on its include path, so that tools, the Python binding and schedulers on machines without LibTorch
# can use it.
add_library(remat_planner
  src/planner/units.cpp
  src/planner/planner.cpp
  src/planner/device.cpp
  src/planner/batch.cpp
  src/planner/timeline.cpp
  src/planner/chain.cpp
  src/planner/plan.cpp
  src/planner/baselines.cpp
  src/planner/optimal.cpp
  src/planner/per_layer.cpp
  src/planner/step.cpp
  src/planner/figures.cpp
  src/planner/revolve.cpp
  src/planner/strategy.cpp
  src/planner/report.cpp
)
add_library(remat::planner ALIAS remat_planner)
set_target_properties(remat_planner PROPERTIES EXPORT_NAME planner)
target_include_directories(remat_planner
  PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
         $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(remat_planner PUBLIC cxx_std_17)
target_compile_options(remat_planner PRIVATE -Wall -Wextra)
# nlohmann/json stays private: no installed header includes it. Threads: the per-layer planner's
# (PlannerOptions::threads), which a static library's users link too.
find_package(Threads REQUIRED)
target_link_libraries(remat_planner PRIVATE $<BUILD_INTERFACE:nlohmann_json::nlohmann_json>
                      PUBLIC Threads::Threads)
