"""The launcher's usage record on a full disk: ``/dev/full`` answers every write with ENOSPC ("No space left on
device"), the error a run hit when its disk filled. The record is telemetry: the launcher must keep supervising,
say so once, and write again when it can (before, the OSError escaped its supervision loop and the launcher
hung with its services orphaned)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from services.launcher.usage import UsageLog


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full to get a real ENOSPC")
def test_a_full_disk_is_said_once_and_the_record_resumes_when_it_can(tmp_path, caplog):
    log = UsageLog(Path("/dev/full"), every_s=0.0)
    me = lambda: {"me": os.getpid()}  # noqa: E731 - this process: a real process tree to sample
    with caplog.at_level(logging.WARNING, logger="rlbus.launcher"):
        log.record(me)  # ENOSPC: said, not raised
        log.record(me)  # still failing: not said again
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
        log.path = tmp_path / "usage.jsonl"  # room again
        log.record(me, force=True)
    assert "again" in caplog.records[-1].getMessage()
    line = json.loads(log.path.read_text().splitlines()[-1])
    assert line["cpu_s"]["me"] > 0 and line["rss_bytes"]["me"] > 0
