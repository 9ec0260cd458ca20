"""Checkpoints that scale: sharded state through ``torch.distributed.checkpoint``, a readable model beside it.

``<root>/step-<N>/`` holds

* ``dcp/``: model and optimiser state as written by ``torch.distributed.checkpoint`` (DCP), each
  rank its own shard. DCP records the global shape of every tensor, so a checkpoint written by
  2 ranks loads into 1 rank (or 4) as well: the resharding happens on load;
* the model as a Hugging Face directory (config, safetensors, tokenizer: what
  ``AutoModelForCausalLM.from_pretrained`` reads, and what a restarted trainer builds its model
  from before DCP fills in the state), gathered onto and written by rank 0;
* ``extra.pt`` (learning-rate schedule, RNG) and ``trainer_state.json`` (the bookkeeping).

With LoRA (``lora`` set) the checkpoint holds the adapters only: DCP saves the adapter tensors and their
optimiser moments, ``adapter/`` is the peft adapter directory, and no model directory is written (a
restarted trainer builds the base model from ``model`` again and loads the adapters into it).

The directory is written under a temporary name and renamed into place by rank 0 once every rank
has written its shard; ``latest`` then points at it, and the two newest are kept. DCP needs a
filesystem every rank sees (one host here; a shared filesystem across nodes).

Rank 0 drives a checkpoint (:meth:`~services.trainer.learner.Learner.save_checkpoint`): :func:`staging`, then
every rank's :func:`write` (the operation ``WRITE_CHECKPOINT`` of :mod:`services.trainer.rank_ops`), then
:func:`commit`. The functions here take any object with the attributes of :class:`RankState` (a learner), so
that this module does not import the learner, which uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from services.lib.model_io import save_policy
from services.trainer.config import LoraConfig


class RankState(Protocol):
    """What a checkpoint reads and writes of one rank's learner."""

    rank: int
    world_size: int
    lora: LoraConfig | None
    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    tokenizer: Any

    def gathered_state_dict(self) -> dict[str, torch.Tensor]: ...

    def gather_weights(self, dtype: torch.dtype | None = None, adapters_only: bool = False) -> dict[str, torch.Tensor]: ...


def staging(root: Path, step: int) -> Path:
    """The empty directory every rank writes step ``step``'s checkpoint into (rank 0 calls this first)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def commit(learner: RankState, tmp: Path, trainer_state: dict[str, Any]) -> Path:
    """After every rank's :func:`write` into ``tmp`` (from :func:`staging`): add rank 0's state, rename it to
    ``<root>/step-<N>`` atomically, point ``latest`` at it and keep the two newest (rank 0 calls this)."""
    root = tmp.parent
    final = root / tmp.name.removeprefix(".tmp-")
    torch.save({"scheduler": learner.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}, tmp / "extra.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
    # a step written again (the final checkpoint after a periodic one of the same step): the old one is moved
    # aside, not deleted first, so a crash leaves one whole directory under the name, never a half-deleted one
    old_copy = root / f".old-{final.name}"
    shutil.rmtree(old_copy, ignore_errors=True)
    if final.exists():
        os.replace(final, old_copy)
    os.replace(tmp, final)
    shutil.rmtree(old_copy, ignore_errors=True)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write(learner: RankState, path: str) -> None:
    """This rank's part of a checkpoint: the HF directory (rank 0, gathered), then its DCP shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = Path(path)
    if learner.lora is not None:  # the adapters, not the frozen base
        out.mkdir(parents=True, exist_ok=True)
        save_adapter_local(learner, str(out / "adapter"))  # every rank takes part in the gather
    else:
        save_hf_local(learner, out)  # first: it writes the directory as a whole
    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
    if learner.lora is not None:
        model_sd = _adapters_only(model_sd)
    with _one_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "dcp"))


def _adapters_only(model_sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_sd.items() if "lora_" in k}


def save_adapter_local(learner: RankState, path: str) -> None:
    """LoRA: the adapters as a peft directory, written by rank 0 (every rank takes part in the gather)."""
    from services.trainer.lora import save_adapter

    full = None
    if learner.world_size > 1:  # the adapters alone are gathered, never the frozen base
        full = {k: v.cpu() for k, v in learner.gather_weights(adapters_only=True).items()}
    if learner.rank == 0:
        save_adapter(learner.model, path, state_dict=full)


def save_hf_local(learner: RankState, out: str | Path) -> None:
    """The model as a Hugging Face directory (float32 master weights; with LoRA the adapters merged in), written
    by rank 0 (every rank takes part in the gather)."""
    if learner.lora is not None:  # the adapters merged into a plain model directory
        from services.trainer.lora import merged_from_state_dict

        full = learner.gathered_state_dict()
        if learner.rank == 0:
            save_policy(learner.model.get_base_model(), learner.tokenizer, out,
                        state_dict=merged_from_state_dict(full, learner.lora))
        return
    if learner.world_size == 1:
        save_policy(learner.model, learner.tokenizer, out)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if learner.rank == 0:
        save_policy(learner.model, learner.tokenizer, out, state_dict=full)


def trainer_state(ckpt: Path) -> dict[str, Any]:
    """The trainer's bookkeeping saved with ``ckpt``."""
    return json.loads((ckpt / "trainer_state.json").read_text())


def read(learner: RankState, path: str) -> None:
    """This rank's part of loading a checkpoint (DCP reshards to this world size)."""
    ckpt = Path(path)
    if (ckpt / "dcp").is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
        lora = learner.lora is not None
        state = {"model": _adapters_only(model_sd) if lora else model_sd, "optim": optim_sd}
        with _one_process_quiet():
            dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
        set_state_dict(learner.model, learner.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=not lora))
        extra = torch.load(ckpt / "extra.pt", weights_only=False)
    else:  # a checkpoint written before sharded checkpoints (one rank): the optimiser in optimizer.pt
        extra = torch.load(ckpt / "optimizer.pt", weights_only=False)
        learner.optimizer.load_state_dict(extra["optimizer"])
    learner.scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """One rank without a process group is DCP's single-process mode, which is meant here: no warning."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
