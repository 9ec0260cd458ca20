"""What the training loop starts with, and the order it is set up in (rank 0, the process on the bus):

1. the task and the learner, from the newest checkpoint or the configured model (:func:`resume.load`);
2. in a ``trainer+rollout`` process, the learner handed to the colocated engines' device share: on a GPU its
   weights and optimiser state move to the host between steps (:class:`~services.lib.colocation.HostOffload`),
   so the engines, which start once this is said, can take the device (:func:`share_device`);
3. the weight transport's sender, started (and closed when the run ends, however it ends);
4. the newest durable point: the state saved in KV and the newest kept version decide where the run continues
   (:func:`resume.continue_from_saved`), and the ledger takes that state;
5. ``[model] chat_template``, if set, on the learner's tokenizer (the tickets render prompts with it).

Nothing here trains, publishes a version or admits a prompt: that is the loop's (:mod:`services.trainer.service`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from proto import catalog
from services.lib.chat_template import use_chat_template
from services.lib.colocation import DEVICE_SHARE, HostOffload
from services.lib.weights.transport import WeightSender, make_sender
from services.runtime import bus
from services.runtime.config import Loaded
from services.runtime.service import ServiceContext, colocated_names
from services.trainer import resume
from services.trainer.devices import Placement
from services.trainer.learner import Learner
from services.trainer.ledger import Ledger
from services.trainer.ranks import RankGroup
from services.trainer.state import load_from_kv


@dataclass
class Started:
    """The loop's starting point: the resumed task and learner, the running sender, the ledger of the state."""

    start: resume.Start
    sender: WeightSender
    ledger: Ledger


@asynccontextmanager
async def started(ctx: ServiceContext, loaded: Loaded, run_dir: Path, placement: Placement,
                  group: RankGroup | None) -> AsyncIterator[Started]:
    """Steps 1-5 of the module docstring; the sender is closed on the way out."""
    cfg = loaded.service
    start = await asyncio.to_thread(resume.load, cfg, loaded.model, loaded.task, run_dir / "checkpoints",
                                    loaded.run.seed, placement, group)
    await share_device(start.learner, placement, group)
    runs_kv = await bus.ensure_kv(ctx.js, catalog.RUNS)
    sender = make_sender(loaded.weights, ctx.nc, ctx.run_id, device=placement.device)
    await sender.start()
    try:
        await resume.continue_from_saved(start, await load_from_kv(runs_kv, ctx.run_id), sender)
        ledger = Ledger(start.state, runs_kv, ctx.run_id, cfg.max_groups_in_flight)
        use_chat_template(start.learner.tokenizer, loaded.model.chat_template)  # [model] chat_template, if any
        yield Started(start, sender, ledger)
    finally:
        await sender.close()


async def share_device(learner: Learner, placement: Placement, group: RankGroup | None) -> None:
    """In a process with colocated rollout engines (``rlbus service trainer+rollout``), say the learner is
    loaded: their engines start once this is said (:mod:`services.lib.colocation`). On a GPU (one rank) they
    take the device between steps, so the learner's memory moves out of their way; elsewhere nothing moves."""
    if "rollout" not in colocated_names():
        return
    on_gpu = placement.device_type == "cuda" and group is None
    await DEVICE_SHARE.set_trainer(HostOffload([learner.model, learner.ref_model], [learner.optimizer],
                                               placement.device) if on_gpu else None)
