# Install and export. find_package(remat) gives remat::planner always, and remat::runtime, remat::models and the
# umbrella remat::remat when this install has them (built with LibTorch); COMPONENTS planner asks for the
# planner alone, without looking for Torch. Headers are installed by folder, as include/remat lays them out by
# target: include/remat/planner (torch-free) and the planner's forwarding headers at their old paths in both
# cases; the rest of include/remat (the runtime's, models/, distributed/) only with LibTorch.
include(CMakePackageConfigHelpers)
set(REMAT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/remat)
# <remat/chain.h> ... before the planner's headers had their folder: each now includes <remat/planner/...>.
set(REMAT_PLANNER_FORWARDING_HEADERS chain.h plan.h planner.h report.h step.h strategy.h units.h)

install(TARGETS remat_planner EXPORT rematPlannerTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT rematPlannerTargets NAMESPACE remat:: DESTINATION ${REMAT_CMAKE_DIR})
install(DIRECTORY include/remat/planner DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remat FILES_MATCHING PATTERN "*.h")
list(TRANSFORM REMAT_PLANNER_FORWARDING_HEADERS PREPEND include/remat/ OUTPUT_VARIABLE _remat_forwarding)
install(FILES ${_remat_forwarding} ${PROJECT_BINARY_DIR}/include/remat/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remat)

if(NOT REMAT_PLANNER_ONLY)
  set(_remat_installed remat_runtime remat_models remat)
  if(REMAT_HAS_DISTRIBUTED)
    list(APPEND _remat_installed remat_distributed)
  endif()
  install(TARGETS ${_remat_installed} EXPORT rematTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT rematTargets NAMESPACE remat:: DESTINATION ${REMAT_CMAKE_DIR})
  install(TARGETS remat_meter LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(DIRECTORY include/remat DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
endif()

configure_package_config_file(cmake/rematConfig.cmake.in ${PROJECT_BINARY_DIR}/rematConfig.cmake
  INSTALL_DESTINATION ${REMAT_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/rematConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/rematConfig.cmake ${PROJECT_BINARY_DIR}/rematConfigVersion.cmake
  DESTINATION ${REMAT_CMAKE_DIR})
