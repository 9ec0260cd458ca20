"""Where a (re)started trainer continues from: its checkpoint, its saved state, the newest kept weights.

Three durable things survive a trainer crash:

* the newest **checkpoint** (``<run dir>/checkpoints``): weights, optimiser moments, RNG and the
  :class:`~services.trainer.state.TrainerState` of that step — written every ``checkpoint_every`` steps;
* the **saved state** in KV, written after every step once its weight version was sent;
* the **weights the transport keeps** (``WeightSender.latest()``): the store transport keeps every
  version it published; broadcast and inproc keep none.

The bookkeeping never goes back past a published version (the rule: :mod:`services.trainer.ledger`). The
saved state, when newer than the checkpoint's, is what the trainer continues from: its step numbers, data
position, groups in flight and owed outcomes. A step it staged (``pending``) is committed when the transport
keeps that step's version and discarded otherwise. The weights are the kept version when it is the state's
(only the optimiser moments then come from the older checkpoint); otherwise (a transport that keeps none,
or an unreadable one) they are the checkpoint's, sent under a version number above every one published, and
the steps since that checkpoint are a lost timeline for the weights only: their outcomes stand (they were
trained by versions that went out). Step N always starts from version ``v - 1`` where ``v`` is the version it
produced (the one its outcomes name), which is what ``rlbus replay step N`` reads.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.lib.weights.transport import WeightSender
from services.runtime.config import ModelSection, TaskSection
from services.tasks.mixture import Mixture
from services.tasks.models import resolve_model
from services.trainer import ledger
from services.trainer.config import TrainerConfig
from services.trainer.devices import Placement
from services.trainer.learner import Learner
from services.trainer.ranks import RankGroup
from services.trainer.state import TrainerState, from_checkpoint

log = logging.getLogger("rlbus.trainer.resume")


@dataclass
class Start:
    """What the trainer starts from: its task (the run's environments), learner (weights loaded) and
    bookkeeping."""

    task: Mixture
    learner: Learner
    state: TrainerState
    checkpoint: Path | None
    #: the transport already holds the weights of ``state.version`` (resumed from them): no need to send again
    version_kept: bool = False


def base_model(model: ModelSection, seed: int) -> Path:
    """The directory of the run's configured model (``[model]``), built or found in the cache."""
    return resolve_model(model.name, model.cache_dir or None, seed=seed, revision=model.revision or None)


def load(cfg: TrainerConfig, model: ModelSection, task_section: TaskSection, checkpoints: Path, seed: int,
         placement: Placement | None = None, group: RankGroup | None = None) -> Start:
    """Build the task (every environment of ``[task]``) and the learner from the newest checkpoint, else from the configured model (blocking).

    With a rank group, every rank builds its learner from the same directory and loads its shard
    of the checkpoint (written by any number of ranks)."""
    task = Mixture.build(task_section)
    ckpt = Learner.latest_checkpoint(checkpoints)
    # a LoRA checkpoint holds adapters only: the model is the configured base again, the adapters load into it
    model_dir = ckpt if ckpt and cfg.lora is None else base_model(model, seed)
    # the KL reference is the initial policy, not the checkpoint's (LoRA: the base, adapters disabled)
    ref_dir = base_model(model, seed) if ckpt and cfg.loss.kl_coef > 0 and cfg.lora is None else None
    if group is not None:
        group.init(model_dir, ref_dir, placement.dtype if placement else model.dtype)
    learner = Learner(cfg, model_dir, placement, init_method=group.init_method if group else "", group=group,
                      ref_dir=ref_dir)
    state = from_checkpoint(learner.load_optimizer(ckpt)) if ckpt is not None else TrainerState()
    state.state = "running"
    return Start(task=task, learner=learner, state=state, checkpoint=ckpt)


async def continue_from_saved(start: Start, saved: TrainerState | None, sender: WeightSender) -> None:
    """Move ``start`` to the newest durable point (see the module docstring); changes it in place."""
    if saved is None:
        return  # the run's first start
    kept = await _latest_kept(sender)
    kept_version = kept[0] if kept is not None else None
    staged = saved.pending.version if saved.pending is not None else -1
    if saved.state == "running" and saved.step >= start.state.step:
        ledger.resolve_pending(saved, published=kept_version is not None and kept_version == staged)
        start.state = saved
        if kept is not None and kept_version == saved.version:
            await asyncio.to_thread(start.learner.load_weights, kept[1])
            start.version_kept = True
            log.info("resumed at step %d from kept version %d (optimiser from %s)%s", saved.step, saved.version,
                     start.checkpoint or "scratch", "; the step being sent was published" if staged ==
                     saved.version else "")
            return
    newest = max(saved.version, staged, kept_version if kept_version is not None else -1)
    if newest >= start.state.version:
        start.state.version = newest + 1
    log.info("resumed from the weights of %s: step %d, now version %d (kept version: %s)",
             start.checkpoint or "the initial model", start.state.step, start.state.version, kept_version)


async def _latest_kept(sender: WeightSender) -> tuple[int, dict[str, Any]] | None:
    try:
        return await sender.latest()
    except Exception as e:  # unreadable or corrupted: the checkpoint is the fallback
        log.warning("could not read the newest kept weight version (%s); using the checkpoint", e)
        return None
