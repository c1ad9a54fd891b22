"""mpcomm.testing: the public conformance kit for transports.

Every transport — in-tree or third-party — must pass the same checks, run
between two real processes (:mod:`mpcomm.testing.kit`). Three ways to run them:

* without pytest::

      from mpcomm.testing import run_conformance
      report = run_conformance("mytransport")
      print(report.summary()); assert report.ok

* from the command line: ``python -m mpcomm.testing mytransport``;

* with pytest: the plugin registered through the ``pytest11`` entry point
  provides the fixture ``mpcomm_conformance`` (one environment per available
  transport, or per ``--mpcomm-transport NAME``) and ``mpcomm_check`` (each
  check), so a plugin author's whole test is::

      def test_conformance(mpcomm_conformance, mpcomm_check):
          mpcomm_check(mpcomm_conformance)
"""

from __future__ import annotations

from .kit import (
    CHECKS,
    CheckResult,
    ConformanceEnv,
    LineProcess,
    Report,
    Skip,
    TargetProcess,
    plugin_module,
    run_conformance,
)
from .patterns import pattern

__all__ = [
    "CHECKS", "CheckResult", "ConformanceEnv", "LineProcess", "PythonThreads", "Report", "Skip", "TargetProcess",
    "check_completion_on_waiter", "pattern", "plugin_module", "run_conformance",
]


def __getattr__(name: str) -> object:
    # The completion check is imported on first use: ``python -m mpcomm.testing.completion``
    # must find that module not imported yet.
    if name in ("PythonThreads", "check_completion_on_waiter"):
        from . import completion

        return getattr(completion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
