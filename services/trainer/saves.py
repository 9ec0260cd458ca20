"""What the trainer leaves in its run directory.

* ``checkpoints/``: a checkpoint every ``checkpoint_every`` steps, with the ledger's state of its step (what one
  holds and how every rank writes its shard: :mod:`services.trainer.checkpoint`);
* at the end of a run that was not stopped: ``final_model/`` (a Hugging Face directory; LoRA: the adapters
  merged in), ``final_adapter/`` (LoRA only: the adapters on their own, a peft directory), a last checkpoint
  and ``summary.json``, and the state saved as ``finished``.

**A full disk skips a periodic checkpoint; it does not stop the run.** When a periodic checkpoint's write
fails and the disk it goes to is full (ENOSPC or EDQUOT, or under :data:`DISK_FULL_BYTES` free after the
failure: torch's writer reports a short write as a RuntimeError), its half-written directory is removed,
which gives its space back, and the error says how much is free and which checkpoint the run would resume from.
Training goes on and the next checkpoint tries again. Stopping instead would make the launcher restart the
trainer from the last checkpoint over and over, each time failing at the same write: no progress, and
nothing more saved. Several ranks write one checkpoint together, so there the failure still stops the
trainer, as does a failure of the final checkpoint.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import shutil
import time
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from services.lib.engine import staging
from services.trainer.learner import Learner
from services.trainer.ledger import Ledger
from services.trainer.state import summary_of

log = logging.getLogger("rlbus.trainer")


#: free bytes under which a failed checkpoint write counts as the disk being full
DISK_FULL_BYTES = 16 << 20


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem holding ``path`` (or its nearest existing parent)."""
    existing = next((p for p in (path, *path.parents) if p.is_dir()), None)
    return staging.free_bytes(str(existing)) if existing is not None else None


def _disk_full(e: BaseException, free: int | None) -> bool:
    todo: list[BaseException] = [e]
    while todo:
        seen = todo.pop()
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(seen, "failures", None)  # torch's CheckpointException: each rank's error
        todo += [f for f in (failures.values() if isinstance(failures, dict) else ()) if isinstance(f, BaseException)]
        todo += [c for c in (seen.__cause__, seen.__context__) if c is not None]
    return free is not None and free < DISK_FULL_BYTES


async def checkpoint(learner: Learner, ledger: Ledger, run_dir: Path, *, required: bool = False) -> bool:
    """A checkpoint of the ledger's current step (every rank writes its shard). True when written; False when
    a periodic one was skipped because the disk is full (see the module docstring); ``required`` (the final
    checkpoint) raises instead."""
    root, step = run_dir / "checkpoints", ledger.state.step
    try:
        await asyncio.to_thread(learner.save_checkpoint, root, step, ledger.for_checkpoint())
        return True
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        free = free_bytes(root)
        if learner.rank == 0:  # a partial write is of no use: its space back, whatever happens next
            await asyncio.to_thread(shutil.rmtree, root / f".tmp-step-{step:06d}", True)
        if required or learner.world_size > 1 or not _disk_full(e, free):
            raise
        latest = learner.latest_checkpoint(root)
        after = free_bytes(root)
        log.error("checkpoint of step %d NOT written: the disk under %s is full (%s: %s; %.1f MiB free after "
                  "removing the partial write). Training goes on; a restart now would resume from %s. The next "
                  "checkpoint tries again: free space there", step, root, type(e).__name__, e,
                  (after or 0) / 2**20, latest.name if latest is not None else "the start (no checkpoint yet)")
        return False


async def finish(learner: Learner, ledger: Ledger, run_dir: Path, *, lora: bool, started: float) -> None:
    """Final model, checkpoint and summary (``started``: the run's start, for its wall time); the state says
    ``finished``."""
    final = run_dir / "final_model"
    await asyncio.to_thread(learner.save_pretrained, final)  # LoRA: adapters merged in
    extra = {}
    if lora:  # and the adapters on their own, as a peft directory
        extra["final_adapter"] = str(await asyncio.to_thread(learner.save_adapter, run_dir / "final_adapter"))
    await checkpoint(learner, ledger, run_dir, required=True)
    ledger.finish(str(final))
    summary = summary_of(ledger.state, wall_s=time.time() - started, **extra)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    await ledger.save()
    log.info("finished: %d steps, final model in %s", ledger.state.step, final)
