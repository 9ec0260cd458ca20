"""The trainer's configuration (section ``[services.trainer]``). No ML imports here."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.runtime.weights_config import StoreTransportConfig, TransportConfig
from services.runtime.config import ConfigError, TaskOption

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]

#: the linear layers of Llama/Qwen/Mistral-style decoders
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer] lora = { r, alpha, dropout, target_modules }``: train low-rank adapters (peft)
    instead of every weight; only the adapters travel to the engines per version."""

    #: rank of the adapter matrices
    r: Annotated[int, msgspec.Meta(ge=1)] = 8
    #: scale numerator: the update is (alpha / r) · B A
    alpha: Annotated[float, msgspec.Meta(gt=0)] = 16.0
    #: dropout on the adapter's input during training
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    #: names (suffixes) of the linear modules that get adapters
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # --- model and task ---
    #: builtin model (tiny-addition, smollm2) or a Hugging Face directory
    model: str = "tiny-addition"
    #: where builtin models are built and cached (default ~/.cache/rlbus or $RLBUS_CACHE)
    cache_dir: str = ""
    #: training precision: float32, or bfloat16 mixed precision (bf16 compute, fp32 master weights and
    #: optimiser moments; weights are sent to the engines in bf16)
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: task name from the task registry, and its options
    task: str = "addition"
    task_options: dict[str, TaskOption] = {}

    #: LoRA adapters instead of full fine-tuning (absent: every weight trains): { r = 8, alpha = 16.0,
    #: dropout = 0.0, target_modules = ["q_proj", ...] }. Weight versions then carry only the adapters (the
    #: engines merge them into their base weights); checkpoints hold the adapters and their optimiser state;
    #: the final model is saved merged (final_model/) and as a peft adapter directory (final_adapter/).
    #: The KL reference (kl_coef > 0) is the base model (adapters disabled). Works with world_size > 1 (FSDP2)
    lora: LoraConfig | None = None

    # --- batch and sampling ---
    #: prompt groups per optimiser step
    groups_per_step: Pos = 16
    #: completions per prompt (the GRPO group)
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8
    #: completion budget (0: the task's own)
    max_new_tokens: NonNeg = 0
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    #: the run stops after this many optimiser steps
    total_steps: Pos = 100
    #: optional wall-clock budget in seconds (0: none); the run stops at the first step past it
    max_wall_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0

    # --- asynchrony ---
    #: a sample is trained on only if its oldest token is at most this many versions old;
    #: at most (max_staleness + 1) * groups_per_step groups are in flight. 0 = synchronous on-policy
    max_staleness: NonNeg = 1

    #: a group admitted this many seconds ago and still incomplete is given up (its slot freed,
    #: what arrived of it dropped with the reason); covers work lost with a crashed worker
    group_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0

    # --- objective ---
    normalize_std: bool = True
    clip_low: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.2
    clip_high: Annotated[float, msgspec.Meta(ge=0.0)] = 0.28
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: off-policy correction: truncated IS (default), decoupled PPO, or none
    is_mode: Literal["tis", "decoupled", "none"] = "tis"
    is_cap: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    aggregation: Literal["seq_mean_token_mean", "token_mean"] = "seq_mean_token_mean"
    #: passes over each batch; with ``ppo_epochs * minibatches > 1`` the PPO ratio is taken against the
    #: proximal policy (the weights before the batch's first update, its logprobs computed once per batch),
    #: so the clip acts, and ``is_mode`` corrects proximal vs behaviour policy (decoupled PPO, as AReaL)
    ppo_epochs: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    #: optimiser steps per pass: the batch is cut into this many minibatches of about equal tokens (each one
    #: still cut into micro-batches for gradient accumulation); the lr schedule advances once per batch
    minibatches: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    #: per-sample loss weight ``staleness_decay ** k``, ``k`` the versions a sample's oldest token is behind
    #: the freshest sample of its batch (1.0: every sample weighs the same, as before)
    staleness_decay: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0

    # --- optimiser ---
    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-4
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: NonNeg = 0
    #: completions per forward/backward pass (gradient accumulation over the batch)
    micro_batch_size: Pos = 64
    #: padded tokens (rows x longest prompt+completion) per forward/backward pass; 0: only
    #: ``micro_batch_size`` bounds a micro-batch. A sequence longer than the budget runs alone
    max_tokens_per_micro_batch: NonNeg = 0
    #: recompute activations in the backward pass (less memory, ~30% more compute)
    gradient_checkpointing: bool = False

    # --- devices and ranks ---
    #: where the policy trains: "auto" (cuda when present, else cpu), "cpu", "cuda" or "cuda:N";
    #: with world_size > 1 on CUDA, rank r takes cuda:r
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    #: where the reference model (kl_coef > 0) lives: "" (the policy's device), "cpu", "cuda" or "cuda:N"
    ref_device: Annotated[str, msgspec.Meta(pattern=r"^(|cpu|cuda(:[0-9]+)?)$")] = ""
    #: trainer processes (ranks) of this one service instance, sharded with FSDP2 (gloo on CPU,
    #: NCCL on CUDA); only rank 0 talks to the bus, the batch is split across ranks
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    #: a collective (or the group's start) taking longer than this fails the rank group, which the
    #: launcher then restarts from its newest durable point
    rank_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0

    # --- evaluation, checkpoints, resources ---
    #: evaluate on the held-out prompts every this many steps (0: only at start and end)
    eval_every: NonNeg = 10
    #: held-out prompts per evaluation (0: all the task has)
    eval_prompts: NonNeg = 0
    #: samples per held-out prompt (more: a less noisy eval reward)
    eval_samples: Pos = 1
    eval_temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    #: save a resumable checkpoint every this many steps (0: only the final model)
    checkpoint_every: NonNeg = 20
    #: torch intra-op threads (0: torch's default)
    num_threads: NonNeg = 0
    #: send a step's weight version and commit its batch while the next batch is collected and trained on
    #: (the state, outcomes and acks stay in step order); off: each step is sent and committed before the
    #: next begins. Always off while colocated engines sleep during learner steps (enable_sleep_mode)
    overlap_publish: bool = True
    #: how weight versions reach the engines (the rollouts' ``transport`` must match), chosen by ``type``:
    #: { type = "store", store = {...}, encoding = {...} } (the default: anchors + deltas in a blob store,
    #: objstore, s3 or fs; sends retried while the bus is away, the newest version kept for resuming),
    #: { type = "broadcast", world_size = 1 + rollout engines } (torch.distributed, rendezvous over the bus),
    #: { type = "inproc" } (trainer and rollout colocated: ``[launcher] services = { "trainer+rollout" = 1 }``).
    #: See services/runtime/weights_config.py for every field.
    transport: TransportConfig = msgspec.field(default_factory=StoreTransportConfig)

    def __post_init__(self) -> None:
        if self.minibatches > self.groups_per_step * self.group_size:
            raise ConfigError(f"config key services.trainer.minibatches is {self.minibatches}, more than the "
                              f"{self.groups_per_step * self.group_size} completions of a batch (groups_per_step x "
                              "group_size): lower it")

    @property
    def max_groups_in_flight(self) -> int:
        return (self.max_staleness + 1) * self.groups_per_step
