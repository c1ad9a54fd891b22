"""Settings every test directory shares.

Engines rank their default route by this node's calibration file
(mpcomm.calibration), by default the user's ``~/.cache/mpcomm/bandwidth.json``:
the suite must not depend on what someone measured on the machine it runs
on, so it points every engine (and every process it spawns) at a file that
does not exist. Tests of the calibration set their own.
"""

from __future__ import annotations

import os
import tempfile

os.environ["MPCOMM_CALIBRATION_FILE"] = os.path.join(
    tempfile.gettempdir(), f"mpcomm-tests-{os.getpid()}-no-calibration.json")
