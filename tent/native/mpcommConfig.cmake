# CMake package config of mpcomm's MPComm provider (find_package(mpcomm CONFIG)).
# The prefix is the mpcomm package directory: <prefix>/include/mpcomm.h and
# <prefix>/lib/libmpcomm.so.1 (the versioned file: in a wheel, lib/libmpcomm.so is a one-line
# ld script, since a zip holds no symlink); this file lives in <prefix>/lib/cmake/mpcomm/.
get_filename_component(_mpcomm_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

set(mpcomm_INCLUDE_DIR "${_mpcomm_prefix}/include")
set(mpcomm_INCLUDE_DIRS "${mpcomm_INCLUDE_DIR}")
set(mpcomm_LIBRARY "${_mpcomm_prefix}/lib/libmpcomm.so.1")
set(mpcomm_LIBRARIES "${mpcomm_LIBRARY}")

if(NOT EXISTS "${mpcomm_INCLUDE_DIR}/mpcomm.h" OR NOT EXISTS "${mpcomm_LIBRARY}")
  set(mpcomm_FOUND FALSE)
  set(mpcomm_NOT_FOUND_MESSAGE
      "mpcomm's native provider is not built under ${_mpcomm_prefix} (see native-status.json there, or run python -m mpcomm.tent.build)")
  return()
endif()

if(NOT TARGET mpcomm::mpcomm)
  add_library(mpcomm::mpcomm SHARED IMPORTED)
  set_target_properties(
    mpcomm::mpcomm
    PROPERTIES IMPORTED_LOCATION "${_mpcomm_prefix}/lib/libmpcomm.so.1"
               IMPORTED_SONAME "libmpcomm.so.1"
               INTERFACE_INCLUDE_DIRECTORIES "${mpcomm_INCLUDE_DIR}")
endif()
unset(_mpcomm_prefix)
