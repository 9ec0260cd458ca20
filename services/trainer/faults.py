"""Fault points for the chaos tests, off unless their environment variable is set."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger("rlbus.trainer")

#: a fault point for the chaos tests: the trainer SIGKILLs itself once, right after sending this version
FAULT_ENV = "RLBUS_TRAINER_KILL_AFTER_SENDING"


def fault_point(run_dir: Path, version: int) -> None:
    """With ``$RLBUS_TRAINER_KILL_AFTER_SENDING = v``: die (SIGKILL) after sending version ``v`` and before its
    step's state is saved, the first time only (a marker file in the run directory)."""
    want = os.environ.get(FAULT_ENV, "")
    marker = run_dir / f"fault-killed-after-v{version}"
    if want.isdigit() and int(want) == version and not marker.exists():
        marker.touch()
        log.warning("fault point: killed after sending version %d, before saving its step", version)
        os.kill(os.getpid(), signal.SIGKILL)
