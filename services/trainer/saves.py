"""What the trainer leaves in its run directory.

* ``checkpoints/``: a checkpoint every ``checkpoint_every`` steps, with the ledger's state of its step (what one
  holds and how every rank writes its shard: :mod:`services.trainer.checkpoint`);
* at the end of a run that was not stopped: ``final_model/`` (a Hugging Face directory; LoRA: the adapters
  merged in), ``final_adapter/`` (LoRA only: the adapters on their own, a peft directory), a last checkpoint
  and ``summary.json``, and the state saved as ``finished``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from services.trainer.learner import Learner
from services.trainer.ledger import Ledger
from services.trainer.state import summary_of

log = logging.getLogger("rlbus.trainer")


async def checkpoint(learner: Learner, ledger: Ledger, run_dir: Path) -> None:
    """A checkpoint of the ledger's current step (every rank writes its shard)."""
    await asyncio.to_thread(learner.save_checkpoint, run_dir / "checkpoints", ledger.state.step,
                            ledger.for_checkpoint())


async def finish(learner: Learner, ledger: Ledger, run_dir: Path, *, lora: bool, started: float) -> None:
    """Final model, checkpoint and summary (``started``: the run's start, for its wall time); the state says
    ``finished``."""
    final = run_dir / "final_model"
    await asyncio.to_thread(learner.save_pretrained, final)  # LoRA: adapters merged in
    extra = {}
    if lora:  # and the adapters on their own, as a peft directory
        extra["final_adapter"] = str(await asyncio.to_thread(learner.save_adapter, run_dir / "final_adapter"))
    await checkpoint(learner, ledger, run_dir)
    ledger.finish(str(final))
    summary = summary_of(ledger.state, wall_s=time.time() - started, **extra)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    await ledger.save()
    log.info("finished: %d steps, final model in %s", ledger.state.step, final)
