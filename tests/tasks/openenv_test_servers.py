"""OpenEnv servers that fail to start, for tests/tasks/test_openenv_env.py: the server process imports this
module, and the environment variable (set by the test after the task was built in-process) says how it fails."""

from __future__ import annotations

import os
import time

from examples.openenv_guess import GuessTheNumber

HOW = "RLBUS_TEST_OPENENV_SERVER"

if os.environ.get(HOW) == "slow":
    time.sleep(60)  # never up within the test's start_timeout_s
elif os.environ.get(HOW) == "crash":
    raise RuntimeError("this server cannot start")

__all__ = ["GuessTheNumber"]
