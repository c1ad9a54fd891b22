"""The installed CMake package config: found under MPCOMM_ROOT as Mooncake looks for it (1.x, >= 1.4)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mpcomm.tent.build import native_status

HERE = Path(__file__).resolve().parent

PROJECT = """
cmake_minimum_required(VERSION 3.16)
project(find_mpcomm CXX)
if(POLICY CMP0144)
  cmake_policy(SET CMP0144 NEW)
endif()
find_package(mpcomm CONFIG QUIET HINTS ${MPCOMM_ROOT})
if(NOT mpcomm_FOUND)
  message(FATAL_ERROR "mpcomm package config not found under ${MPCOMM_ROOT}")
endif()
if(mpcomm_VERSION VERSION_LESS 1.4 OR NOT mpcomm_VERSION_MAJOR EQUAL 1)
  message(FATAL_ERROR "wrong version ${mpcomm_VERSION}")
endif()
message(STATUS "FOUND mpcomm ${mpcomm_VERSION} major ${mpcomm_VERSION_MAJOR}")
find_package(mpcomm 2.0 CONFIG QUIET HINTS ${MPCOMM_ROOT})
if(mpcomm_FOUND)
  message(FATAL_ERROR "a 2.0 request must not accept 1.x")
endif()
find_package(mpcomm 1.4 CONFIG REQUIRED HINTS ${MPCOMM_ROOT})
add_executable(tent_host ${HOST_SRC})
target_link_libraries(tent_host PRIVATE mpcomm::mpcomm)
set_target_properties(tent_host PROPERTIES BUILD_RPATH "${MPCOMM_ROOT}/lib")
"""


def test_package_config_version_and_target(tmp_path: Path) -> None:
    st = native_status()
    if not st["built"]:
        pytest.skip(st["reason"])
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("cmake or a C++ compiler is missing")
    (tmp_path / "CMakeLists.txt").write_text(PROJECT)
    build = tmp_path / "build"
    cfg = subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(build), f"-DMPCOMM_ROOT={st['root']}",
                          f"-DHOST_SRC={HERE / 'tent_host.cpp'}"], capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    assert "FOUND mpcomm 1.4.0 major 1" in cfg.stdout
    b = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    assert (build / "tent_host").exists()
