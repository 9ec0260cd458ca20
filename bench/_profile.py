"""Profile a service of a bench's run with py-spy, and say where its time went.

``ServiceProfile(run_dir, "trainer", out)`` waits (in a thread) for the run's trainer process to appear
(a ``rlbus service trainer`` whose command line names ``run_dir``), records it with ``py-spy record
--format raw --threads --nonblocking`` until it exits, and :meth:`ServiceProfile.summary` reads the
collapsed stacks back as shares of the process's active samples:

* ``buckets``: the learner's step (forward, backward, optimiser), sending weights, the bus and event loop,
  the trainer's own bookkeeping, other (the first bucket one of whose substrings is in one of a sample's frames,
  see ``BUCKETS``; py-spy names a frame ``function (file:line)``, the file with or without its package);
* ``threads``: per thread (the learner runs in a worker thread, the bus in the event loop's thread);
* ``top``: the ten functions most often on top of the stack.

py-spy (``pip install py-spy``) must be on PATH or next to this interpreter; without it the profile says so
and the bench goes on. Sampling is ``--nonblocking`` (the process is not paused), so the profile costs the run
little but a sample may now and then be torn.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.profile")

#: (bucket, substrings of a frame): a sample goes to the first bucket any of whose substrings is in one of
#: its frames (searched from the stack's root down)
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("learner: backward", ("_engine_run_backward (", "backward (torch/")),
    ("learner: optimiser", ("optimizer_step (",)),
    ("learner: forward", ("sequence_logprobs (",)),
    ("learner: other", ("learner.py",)),
    ("weights: state dict + send", ("weights/", "_send_weights (", "_publish_version (")),
    ("checkpoint", ("checkpoint.py",)),
    ("bus: consume, decode, publish", ("nats/", "runtime/", "msgspec", "codec.py", "catalog.py")),
    ("trainer: collect, outcomes, state", ("collect.py", "admission.py", "trainer/service.py", "state.py")),
    ("event loop (other)", ("asyncio/", "uvloop")),
]


def py_spy() -> str | None:
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.is_file() else shutil.which("py-spy")


def find_service(run_dir: Path, service: str) -> int | None:
    """The pid of ``rlbus service <service>`` whose command line names ``run_dir``."""
    needle = str(run_dir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "service" in args and service in args and any(needle in a for a in args):
            i = args.index("service")
            if i + 1 < len(args) and args[i + 1] == service:
                return int(entry.name)
    return None


class ServiceProfile:
    """Records one service of a run with py-spy from the moment it starts until it exits."""

    def __init__(self, run_dir: Path, service: str, out: Path, rate: int = 50, wait_s: float = 300.0) -> None:
        self.run_dir, self.service, self.out, self.rate, self.wait_s = run_dir, service, out, rate, wait_s
        self.error = ""
        self._thread = threading.Thread(target=self._record, name=f"profile-{service}", daemon=True)

    def __enter__(self) -> ServiceProfile:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._thread.join(30.0)

    def _record(self) -> None:
        exe = py_spy()
        if exe is None:
            self.error = "py-spy is not installed (pip install py-spy)"
            return
        deadline = time.monotonic() + self.wait_s
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = find_service(self.run_dir, self.service)
            if pid is None:
                time.sleep(0.2)
        if pid is None:
            self.error = f"no {self.service} process of {self.run_dir} appeared within {self.wait_s:.0f}s"
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--threads", "--nonblocking",
                "--rate", str(self.rate), "--output", str(self.out)]
        log.info("profiling %s (pid %d) into %s", self.service, pid, self.out)
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not self.out.is_file():
            self.error = f"py-spy wrote nothing (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"

    def summary(self) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        return summarize(self.out)


def summarize(raw: Path, top: int = 10) -> dict[str, Any]:
    """Shares of active samples by bucket, by thread and by top-of-stack function, from a py-spy raw file."""
    buckets: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else "?"
        threads[thread] += n
        leaves[frames[-1]] += n
        bucket = next((name for name, keys in BUCKETS if any(k in f for f in frames for k in keys)), "other")
        buckets[bucket] += n
    if total == 0:
        return {"error": f"{raw} holds no samples", "samples": 0}

    def shares(c: Counter[str], n: int | None = None) -> dict[str, float]:
        return {k: round(v / total, 3) for k, v in c.most_common(n)}

    return {"samples": total, "buckets": shares(buckets), "threads": shares(threads, 6), "top": shares(leaves, top),
            "file": str(raw)}


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="summarise a py-spy raw profile (written with --threads)")
    parser.add_argument("raw", type=Path)
    args = parser.parse_args()
    print(json.dumps(summarize(args.raw), indent=1))


if __name__ == "__main__":
    main()
