# nlohmann/json (header-only), for the planner library's chain and plan JSON, the harness and the command line.
# Found as a CMake package (Debian's nlohmann-json3-dev, vcpkg, conda), else as a header (REMAT_JSON_INCLUDE_DIR,
# e.g. the include/ folder of PyPI's nlohmann_json package, which the Python package's isolated build has), else
# fetched from the project's release (REMAT_JSON_URL; this needs network access at configure time).
set(REMAT_JSON_URL "https://github.com/nlohmann/json/releases/download/v3.11.3/json.tar.xz"
    CACHE STRING "Where to fetch nlohmann/json when it is neither installed nor given")
if(NOT TARGET nlohmann_json::nlohmann_json)
  find_package(nlohmann_json 3.2 QUIET)
endif()
if(NOT TARGET nlohmann_json::nlohmann_json)
  find_path(REMAT_JSON_INCLUDE_DIR nlohmann/json.hpp DOC "the folder holding nlohmann/json.hpp")
  if(REMAT_JSON_INCLUDE_DIR)
    add_library(remat_json INTERFACE)
    target_include_directories(remat_json SYSTEM INTERFACE ${REMAT_JSON_INCLUDE_DIR})
    add_library(nlohmann_json::nlohmann_json ALIAS remat_json)
    message(STATUS "remat: nlohmann/json header in ${REMAT_JSON_INCLUDE_DIR}")
  else()
    message(STATUS "remat: nlohmann/json not found; fetching ${REMAT_JSON_URL}")
    include(FetchContent)
    FetchContent_Declare(nlohmann_json URL ${REMAT_JSON_URL} DOWNLOAD_EXTRACT_TIMESTAMP ON)
    FetchContent_MakeAvailable(nlohmann_json)
  endif()
endif()
