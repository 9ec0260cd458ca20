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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from services.lib.model_io import save_policy

if TYPE_CHECKING:
    from services.trainer.learner import Learner


def save(learner: Learner, root: Path, step: int, trainer_state: dict[str, Any]) -> Path:
    """Atomically write ``root/step-<N>`` with every rank and point ``latest`` at it (rank 0 calls this)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    learner._all("write_checkpoint", str(tmp))
    torch.save({"scheduler": learner.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}, tmp / "extra.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write(learner: Learner, path: str) -> None:
    """This rank's part of a checkpoint: the HF directory (rank 0, gathered), then its DCP shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = Path(path)
    if learner.lora is not None:  # the adapters, not the frozen base
        out.mkdir(parents=True, exist_ok=True)
        learner.save_adapter_local(str(out / "adapter"))  # every rank takes part in the gather
    else:
        save_hf_local(learner, out)  # first: it writes the directory as a whole
    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
    if learner.lora is not None:
        model_sd = _adapters_only(model_sd)
    with _one_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "dcp"))


def save_hf(learner: Learner, out: Path) -> Path:
    """The model as a Hugging Face directory (rank 0 calls this; every rank takes part in the gather)."""
    learner._all("save_hf_local", str(out))
    return out


def _adapters_only(model_sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_sd.items() if "lora_" in k}


def save_hf_local(learner: Learner, out: str | Path) -> None:
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


def load(learner: Learner, ckpt: Path) -> dict[str, Any]:
    """Model and optimiser state from ``ckpt`` on every rank (any world size); returns the trainer state."""
    learner._all("read_checkpoint", str(ckpt))
    return json.loads((ckpt / "trainer_state.json").read_text())


def read(learner: Learner, path: str) -> None:
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
