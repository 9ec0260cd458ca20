"""The operations every rank of a trainer runs together, as data.

An :class:`Op` names one; :data:`OPS` maps it to its function ``fn(learner, *args)``: this rank's part of it.
Rank 0 runs one with :meth:`Learner.run_on_all_ranks <services.trainer.learner.Learner.run_on_all_ranks>`,
which sends the op's name and arguments to ranks 1..N-1 (:meth:`services.trainer.ranks.RankGroup.send`); each
of them finds the function with :func:`lookup` (a name not in the table is an error) and calls it on its own
learner, so every rank issues the same collectives in the same order. On one rank the function is simply called.

The functions take any object with the attributes of :class:`RankLearner` (a learner), so that this module does
not import the learner, which uses it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import torch

from services.trainer import checkpoint
from services.trainer.step_input import StepInput


class UnknownRankOp(LookupError):
    """A rank was asked to run an operation that is not in :data:`OPS`."""


class Op(enum.StrEnum):
    STEP = "step"  # one optimiser step on a StepInput; rank 0's metrics
    STATE_DICT = "state_dict"  # the weights as engines take them, gathered onto rank 0
    LOAD_WEIGHTS = "load_weights"  # replace the weights (full tensors on rank 0; the others receive them)
    SAVE_HF = "save_hf"  # the model as a Hugging Face directory
    SAVE_ADAPTER = "save_adapter"  # LoRA: the adapters as a peft directory
    WRITE_CHECKPOINT = "write_checkpoint"  # every rank's shard of a checkpoint
    READ_CHECKPOINT = "read_checkpoint"  # every rank's shard of a checkpoint, resharded to this world size


class RankLearner(checkpoint.RankState, Protocol):
    """What the operations use of one rank's learner (besides what a checkpoint does)."""

    bf16: bool

    def step_input(self, inp: StepInput) -> dict[str, float]: ...


def step(learner: RankLearner, inp: StepInput) -> dict[str, float]:
    return learner.step_input(inp)


def state_dict(learner: RankLearner) -> dict[str, torch.Tensor]:
    """The weights in the training dtype (rank 0; the others take part in the gather and get nothing useful);
    with LoRA the adapters only, in their wire form (services/lib/weights/lora_merge.py). Many ranks: gathered
    tensor by tensor onto rank 0's device, cast on the shards first (LoRA: the adapters alone are gathered)."""
    dtype = torch.bfloat16 if learner.bf16 else None
    if learner.lora is not None:
        from services.trainer.lora import adapter_state, targets_of, wire_from_state_dict

        sd = adapter_state(learner.model) if learner.world_size == 1 else \
            learner.gather_weights(dtype, adapters_only=True)
        return wire_from_state_dict(sd, learner.lora, targets_of(learner.model), dtype)
    if learner.world_size > 1:
        return learner.gather_weights(dtype)
    sd = learner.gathered_state_dict()
    if learner.bf16:
        sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    return sd


def load_weights(learner: RankLearner, state_dict: dict[str, torch.Tensor]) -> None:
    """Replace the weights: ``state_dict`` holds them on rank 0 (in the model's own names) and is empty on the
    others, which receive them by broadcast."""
    if learner.world_size == 1:
        learner.model.load_state_dict(state_dict, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if learner.rank == 0:
        state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    set_model_state_dict(learner.model, state_dict, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))


OPS: dict[Op, Callable[..., Any]] = {
    Op.STEP: step,
    Op.STATE_DICT: state_dict,
    Op.LOAD_WEIGHTS: load_weights,
    Op.SAVE_HF: checkpoint.save_hf_local,
    Op.SAVE_ADAPTER: checkpoint.save_adapter_local,
    Op.WRITE_CHECKPOINT: checkpoint.write,
    Op.READ_CHECKPOINT: checkpoint.read,
}


def op_named(name: str) -> Op:
    """The operation called ``name`` (as rank 0 sends it)."""
    try:
        return Op(name)
    except ValueError:
        raise UnknownRankOp(f"no trainer rank operation {name!r} (the operations: "
                            f"{', '.join(op.value for op in Op)})") from None


def lookup(name: str) -> Callable[..., Any]:
    """This rank's function of the operation called ``name``."""
    return OPS[op_named(name)]
