"""Install-time build of mpcomm's native MPComm provider (libmpcomm.so).

Everything else about the distribution is in pyproject.toml. The native part
is built where a C++ compiler and Python headers exist and skipped otherwise,
with the reason recorded for ``mpcomm doctor`` (see tent/build.py).
"""

import importlib.util
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


def _builder():
    spec = importlib.util.spec_from_file_location("_mpcomm_native_build", HERE / "tent" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class build_native(Command):
    """Compile libmpcomm.so into the mpcomm package directory (an MPCOMM_ROOT)."""

    description = "build mpcomm's MPComm provider library"
    user_options = []
    editable_mode = False

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        # An editable install imports mpcomm from core/, so MPCOMM_ROOT is core/.
        dest = HERE / "core" if self.editable_mode else Path(self.build_lib) / "mpcomm"
        status = _builder().build_native(dest, HERE / "tent" / "native")
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
    """libmpcomm.so embeds this Python's libpython: the wheel is per interpreter and platform."""

    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution, cmdclass={"build": build_with_native, "build_native": build_native})
