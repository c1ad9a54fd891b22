"""Install-time build of mpcomm's native parts; everything else is in pyproject.toml.

Two kinds of native code, both compiled here (when the wheel or the editable
install is built) and never at run time:

* The compiled modules (the engine's native module, shm copy loop, ucx put
  loop, tcp busy-poll and data port): ordinary setuptools ``Extension``
  modules. setuptools is already the build backend, so this needs no extra
  build dependency (meson-python or scikit-build-core would add meson/ninja or
  CMake to every build for a few single-file C modules). The engine's module
  (:data:`REQUIRED`) is the one implementation of the rules it runs, so a
  failure to build it fails the install, saying why. The plugins' helpers are
  optional: where one fails (no compiler, no Python headers), the install still
  succeeds, records which failed and why (``mpcomm/native-build.json``), and
  the plugin runs its pure-Python fallback (``mpcomm doctor`` says what that
  costs; see docs/packaging.md).
* The MPComm provider ``libmpcomm.so.1`` for Mooncake TENT (tent/build.py):
  into the wheel's ``mpcomm/`` (an MPCOMM_ROOT), or for an editable install
  into ``build/native/`` (never into the source tree).
"""

import importlib.util
import json
import sys
from pathlib import Path

from setuptools import Command, Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent

#: import name -> C source; the same table as mpcomm.native_helper.HELPERS (a test compares them).
#: Each source builds as an extension module (MP_PYMODULE) whose C functions are also called through ctypes.
HELPERS = {
    "mpcomm.engine._mpcomm_fastlane": "core/engine/_fastlane.c",
    "mpcomm.plugins.shm._mpcomm_copyloop": "plugins/shm/_copyloop.c",
    "mpcomm.plugins.ucx._mpcomm_ucxloop": "plugins/ucx/_ucxloop.c",
    "mpcomm.plugins.tcp._mpcomm_busypoll": "plugins/tcp/_busypoll.c",
    "mpcomm.plugins.tcp._mpcomm_dataport": "plugins/tcp/_dataport.c",
}
BUILD_RECORD = "native-build.json"  # mpcomm.native_helper.BUILD_RECORD
#: The engine's native module: no fallback, so the install fails without it.
REQUIRED = "mpcomm.engine._mpcomm_fastlane"


def _builder():
    spec = importlib.util.spec_from_file_location("_mpcomm_native_build", HERE / "tent" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class optional_build_ext(build_ext):
    """build_ext where an optional helper that fails to compile is recorded and skipped; the
    engine's module (REQUIRED) failing fails the build."""

    def run(self):
        self._failed = {}
        try:
            super().run()
        except Exception as exc:  # no compiler at all (DistutilsPlatformError and kin)
            for ext in self.extensions:
                if not Path(self.get_ext_fullpath(ext.name)).exists():
                    self._failed.setdefault(ext.name, f"no usable C compiler ({exc})")
        self._record()
        if REQUIRED in self._failed:
            raise SystemExit(f"mpcomm: the engine's native module {REQUIRED} (core/engine/_fastlane.c) is required "
                             f"and was not built: {self._failed[REQUIRED]}. Install a C compiler and Python's "
                             "headers (e.g. gcc and python3-dev), then reinstall mpcomm (`pip install -e .` "
                             "in a checkout).")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, LinkError, a missing cc or Python.h
            why = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            self._failed[ext.name] = f"{type(exc).__name__}: {why[0][:300]}"
            if ext.name != REQUIRED:
                print(f"mpcomm: optional helper {ext.name} not built ({self._failed[ext.name]}); "
                      "its pure-Python fallback will serve", file=sys.stderr)

    def _record(self):
        pkg = Path(self.get_ext_fullpath("mpcomm.x")).parent  # where mpcomm's own files go (in place or build_lib)
        out = pkg / BUILD_RECORD
        if self._failed:
            pkg.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"failed": self._failed}, indent=1) + "\n")
        elif out.exists():
            out.unlink()  # all built now: no stale reasons

    def get_outputs(self):
        outs = super().get_outputs()
        rec = Path(self.get_ext_fullpath("mpcomm.x")).parent / BUILD_RECORD
        return [*outs, str(rec)] if rec.exists() else outs


class build_native(Command):
    """Compile the MPComm provider (libmpcomm.so.1) into an MPCOMM_ROOT."""

    description = "build mpcomm's MPComm provider library"
    user_options = []
    editable_mode = False

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        b = _builder()
        # An editable install must not write into the source tree: its MPCOMM_ROOT is build/native/,
        # which mpcomm.tent.build.native_root() finds beside the checkout.
        dest = b.editable_root(HERE) if self.editable_mode else Path(self.build_lib) / "mpcomm"
        status = b.build_native(dest, HERE / "tent" / "native", for_wheel=not self.editable_mode)
        if status["built"]:
            print(f"mpcomm: built {status['library']}")
        else:
            print(f"mpcomm: native provider skipped: {status['reason']}")

    def get_outputs(self):
        return []

    def get_source_files(self):
        return [f"tent/native/{p.name}" for p in sorted((HERE / "tent" / "native").glob("*"))]

    def get_output_mapping(self):
        return {}


class build_with_native(build):
    sub_commands = [*build.sub_commands, ("build_native", None)]


class BinaryDistribution(Distribution):
    """Extension modules and libmpcomm.so.1 are per interpreter and platform, even where none built."""

    def has_ext_modules(self):
        return True


setup(
    distclass=BinaryDistribution,
    ext_modules=[Extension(name, [src], define_macros=[("MP_PYMODULE", "1")]) for name, src in HELPERS.items()],
    cmdclass={"build": build_with_native, "build_native": build_native, "build_ext": optional_build_ext},
)
