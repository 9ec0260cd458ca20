"""The trainer's configuration (section ``[services.trainer]``, its groups as sub-tables). No ML imports here."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.runtime.config import ConfigError

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


class MismatchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer.loss.mismatch]``: train-inference mismatch, a rejection mask (masked importance
    sampling) on the ratio of the trainer's policy to the engine's (``services/trainer/mismatch.py``)."""

    #: "none"; "token": tokens whose ratio pi_train/mu leaves [low, high] get no policy gradient; "sequence": whole
    #: completions whose product of token ratios leaves it; "geometric": completions whose geometric-mean ratio does
    mask: Literal["none", "token", "sequence", "geometric"] = "none"
    #: the lowest ratio kept
    low: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    #: the highest ratio kept
    high: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ConfigError(f"config keys services.trainer.loss.mismatch.low ({self.low}) and .high ({self.high}): "
                              "low must be below high")


class LossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer.loss]``: the GRPO-family objective (``services/trainer/loss.py``; docs/algorithms.md)."""

    #: the policy term: "grpo" (PPO-clipped token ratios), "dr_grpo" (GRPO without std normalisation and with a
    #: constant normaliser), "gspo" (one length-normalised ratio per completion, clipped per completion) or "cispo"
    #: (clipped detached IS weight on a REINFORCE term: every token keeps its gradient)
    type: Literal["grpo", "dr_grpo", "gspo", "cispo"] = "grpo"
    #: divide each group's advantages by its reward standard deviation (off: only the mean is subtracted);
    #: unset: on, except for type "dr_grpo"
    normalize_std: bool | None = None
    #: the PPO ratio is clipped to [1 - clip_low, 1 + clip_high] (gspo's paper clips its sequence ratio at 3e-4/4e-4)
    clip_low: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.2
    clip_high: Annotated[float, msgspec.Meta(ge=0.0)] = 0.28
    #: weight of the KL penalty against the reference (the initial policy; 0: no reference model)
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: off-policy correction: truncated IS (default), decoupled PPO, icepop (tokens whose weight leaves
    #: [is_floor, is_cap] dropped), or none
    is_mode: Literal["tis", "decoupled", "icepop", "none"] = "tis"
    #: the importance weight's cap (truncated IS; decoupled and icepop drop tokens above it)
    is_cap: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    #: icepop drops tokens whose importance weight is below this
    is_floor: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    #: mean over each completion's tokens then over completions, over every token of the batch, or each
    #: completion's token sum divided by norm_tokens then mean over completions; unset: "seq_mean_token_mean",
    #: except for type "dr_grpo" ("seq_mean_token_sum_norm")
    aggregation: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"] | None = None
    #: the constant normaliser of aggregation "seq_mean_token_sum_norm" (0: sampling.max_new_tokens)
    norm_tokens: NonNeg = 0
    #: per-sample loss weight ``staleness_decay ** k``, ``k`` the versions a sample's oldest token is behind
    #: the freshest sample of its batch (1.0: every sample weighs the same, as before)
    staleness_decay: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    #: completions cut by the token limit (finish_reason "length" or "token_budget") are masked out of the loss
    #: (they still count in their group's advantages)
    mask_truncated: bool = False
    #: DAPO's soft overlong penalty: a completion longer than sampling.max_new_tokens - overlong_buffer tokens
    #: gets a reward penalty growing linearly to overlong_penalty at the limit (0: off)
    overlong_buffer: NonNeg = 0
    #: the soft overlong penalty at the token limit
    overlong_penalty: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    #: train-inference mismatch masks: { mask, low, high }
    mismatch: MismatchConfig = msgspec.field(default_factory=MismatchConfig)

    def __post_init__(self) -> None:
        key = "config key services.trainer.loss"
        if self.type == "dr_grpo":
            if self.normalize_std:
                raise ConfigError(f"{key}.normalize_std is true but type is \"dr_grpo\", which does not divide by "
                                  "the group's std: remove normalize_std, or use type \"grpo\"")
            if self.aggregation not in (None, "seq_mean_token_sum_norm"):
                raise ConfigError(f"{key}.aggregation is {self.aggregation!r} but type is \"dr_grpo\", whose "
                                  "normaliser is a constant (\"seq_mean_token_sum_norm\"): remove aggregation, or "
                                  "use type \"grpo\"")
        if self.type == "gspo" and self.aggregation not in (None, "seq_mean_token_mean"):
            raise ConfigError(f"{key}.aggregation is {self.aggregation!r} but type is \"gspo\", whose ratio is one "
                              "per completion (length-normalised): use aggregation \"seq_mean_token_mean\"")
        if self.is_mode == "icepop" and not self.is_floor < self.is_cap:
            raise ConfigError(f"{key}.is_floor ({self.is_floor}) must be below {key}.is_cap ({self.is_cap}) for "
                              "is_mode \"icepop\"")
        # unset: the type's own
        if self.normalize_std is None:
            self.normalize_std = self.type != "dr_grpo"
        if self.aggregation is None:
            self.aggregation = "seq_mean_token_sum_norm" if self.type == "dr_grpo" else "seq_mean_token_mean"


class OptimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer.optim]``: the optimiser, its schedule, and how a batch is cut into updates."""

    #: AdamW learning rate
    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-4
    #: AdamW decoupled weight decay
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: clip the gradient's global norm to this (0: no clipping)
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    #: the learning rate over the run's total_steps (after the warm-up)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    #: steps of linear warm-up from 0 to lr
    lr_warmup_steps: NonNeg = 0
    #: passes over each batch; with ``ppo_epochs * minibatches > 1`` the PPO ratio is taken against the
    #: proximal policy (the weights before the batch's first update, its logprobs computed once per batch),
    #: so the clip acts, and ``loss.is_mode`` corrects proximal vs behaviour policy (decoupled PPO, as AReaL)
    ppo_epochs: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    #: optimiser steps per pass: the batch is cut into this many minibatches of about equal tokens (each one
    #: still cut into micro-batches for gradient accumulation); the lr schedule advances once per batch
    minibatches: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    #: completions per forward/backward pass (gradient accumulation over the batch)
    micro_batch_size: Pos = 64
    #: padded tokens (rows x longest prompt+completion) per forward/backward pass; 0: only
    #: ``micro_batch_size`` bounds a micro-batch. A sequence longer than the budget runs alone
    max_tokens_per_micro_batch: NonNeg = 0
    #: pack a pass's sequences into rows as wide as its longest one (first-fit decreasing, attention kept
    #: within each sequence) and compute logits only where a completion token is predicted, instead of
    #: right-padding every sequence to the longest (``bench/learner.py`` measures the difference)
    packing: bool = True
    #: with ``packing`` on a CPU learner, attention runs once per packed sequence (causal SDPA on its own
    #: columns) instead of over each whole row under a block-diagonal mask, which computes every row x row
    #: block; the same values (``tests/trainer/test_packing.py``), less attention work (``bench/learner.py``
    #: side ``packed-masked-attention``). On CUDA it stays off (a kernel per sequence per layer; there,
    #: flash-attention's varlen kernels read packed rows). Models whose attention does not go through
    #: transformers' interface, or set to another implementation than sdpa, keep theirs
    varlen_attention: bool = True
    #: recompute activations in the backward pass (less memory, ~30% more compute)
    gradient_checkpointing: bool = False
    #: on CUDA, AdamW's fused kernel (one launch per step instead of several per tensor); CPU keeps the
    #: default implementation
    fused: bool = True


class SamplingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer.sampling]``: how the engines sample the training completions."""

    #: completion budget (0: the task's own)
    max_new_tokens: NonNeg = 0
    #: sampling temperature (the learner's logprobs are taken at the same temperature)
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    #: nucleus sampling: the smallest set of tokens with this much probability
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0


class EvalConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer.eval]``: rounds on the task's held-out prompts."""

    #: evaluate on the held-out prompts every this many steps (0: only at start and end)
    every: NonNeg = 10
    #: held-out prompts per evaluation (0: all the task has)
    prompts: NonNeg = 0
    #: samples per held-out prompt (more: a less noisy eval reward)
    samples: Pos = 1
    #: sampling temperature of the evaluation completions
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0


class DevicesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer.devices]``: where the policy trains, on how many ranks."""

    #: where the policy trains: "auto" (cuda when present, else cpu), "cpu", "cuda" or "cuda:N";
    #: with world_size > 1 on CUDA, rank r takes cuda:r
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    #: where the reference model (loss.kl_coef > 0) lives: "" (the policy's device), "cpu", "cuda" or "cuda:N";
    #: with world_size > 1, "" and "cuda" shard it like the policy on each rank's own device, "cpu" keeps a
    #: whole copy on each rank's host, and "cuda:N" is refused (every rank's copy would sit on one GPU)
    ref_device: Annotated[str, msgspec.Meta(pattern=r"^(|cpu|cuda(:[0-9]+)?)$")] = ""
    #: trainer processes (ranks) of this one rank group, on all its nodes (nnodes), sharded with FSDP2
    #: (gloo on CPU, NCCL on CUDA); only rank 0 talks to the bus, the batch is split across ranks
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    #: a collective (or the group's start) taking longer than this fails the rank group, which the
    #: launcher then restarts from its newest durable point
    rank_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    #: torch intra-op threads (0: torch's default)
    num_threads: NonNeg = 0
    # --- a rank group over several nodes (torchrun's terms: nnodes, node_rank, MASTER_ADDR/PORT) ---
    #: nodes the rank group spans; each runs world_size / nnodes ranks (nproc_per_node), one per GPU
    nnodes: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    #: this node's index (0: the node of rank 0, which alone talks to the bus; ranks r of node n:
    #: n * nproc_per_node <= r < (n + 1) * nproc_per_node)
    node_rank: NonNeg = 0
    #: address of node 0 every node reaches (the rendezvous; "" with nnodes = 1: 127.0.0.1)
    master_addr: str = ""
    #: rendezvous port on node 0 (0 with nnodes = 1: a free one); node 0 also takes master_port + 1 for
    #: the other nodes' command links
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65534)] = 0

    #: on CUDA, float32 matmuls in TF32 (faster, ~10 mantissa bits); ignored on CPU
    tf32: bool = True

    @property
    def nproc_per_node(self) -> int:
        """Ranks on each node."""
        return self.world_size // self.nnodes

    def check(self) -> None:
        """The rank group's shape across nodes; raises ConfigError naming the keys."""
        key = "services.trainer.devices"
        if self.world_size % self.nnodes:
            raise ConfigError(f"config key {key}.world_size ({self.world_size}) is not a multiple of {key}.nnodes "
                              f"({self.nnodes}): every node runs the same number of ranks")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"config key {key}.node_rank is {self.node_rank}, but {key}.nnodes is {self.nnodes} "
                              f"(node ranks 0..{self.nnodes - 1})")
        if self.nnodes > 1 and (not self.master_addr or not self.master_port):
            raise ConfigError(f"config keys {key}.master_addr and {key}.master_port: a group over {self.nnodes} "
                              "nodes needs the address and port of node 0 (torchrun's MASTER_ADDR and MASTER_PORT)")


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[services.trainer]``. The model, the task and the weight transport are the run's (``[model]``,
    ``[task]``, ``[weights]``), read from ``Loaded``."""

    #: LoRA adapters instead of full fine-tuning (absent: every weight trains): { r = 8, alpha = 16.0,
    #: dropout = 0.0, target_modules = ["q_proj", ...] }. Weight versions then carry only the adapters (the
    #: engines merge them into their base weights); checkpoints hold the adapters and their optimiser state;
    #: the final model is saved merged (final_model/) and as a peft adapter directory (final_adapter/).
    #: The KL reference (loss.kl_coef > 0) is the base model (adapters disabled). Works with world_size > 1
    lora: LoraConfig | None = None

    # --- batch ---
    #: prompt groups per optimiser step
    groups_per_step: Pos = 16
    #: DAPO's dynamic sampling: a group whose rewards are all equal (no signal) is dropped when it completes
    #: (outcome "dropped", reason "filtered") and another admitted in its place, so every step still trains
    #: groups_per_step groups
    dynamic_sampling: bool = False
    #: dynamic sampling filters at most this many times groups_per_step groups for one step; past it the step takes
    #: groups as they come (a task whose rewards never differ trains, slowly, instead of generating forever)
    dynamic_sampling_bound: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 8
    #: completions per prompt (the GRPO group)
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8
    #: the run stops after this many optimiser steps
    total_steps: Pos = 100
    #: optional wall-clock budget in seconds (0: none); the run stops at the first step past it
    max_wall_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0

    # --- pacing ---
    #: a sample is trained on only if its oldest token is at most this many versions old;
    #: at most (max_staleness + 1) * groups_per_step groups are in flight. 0 = synchronous on-policy
    max_staleness: NonNeg = 1
    #: a group admitted this many seconds ago and still incomplete is given up (its slot freed,
    #: what arrived of it dropped with the reason); covers work lost with a crashed worker
    group_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0
    #: send a step's weight version and commit its batch while the next batch is collected and trained on
    #: (the state, outcomes and acks stay in step order); off: each step is sent and committed before the
    #: next begins. Always off while colocated engines sleep during learner steps (enable_sleep_mode)
    overlap_publish: bool = True

    # --- checkpointing ---
    #: save a resumable checkpoint every this many steps (0: only the final model)
    checkpoint_every: NonNeg = 20

    # --- groups ---
    #: the objective: { type, normalize_std, clip_low, clip_high, kl_coef, is_mode, is_cap, is_floor, aggregation,
    #: norm_tokens, staleness_decay, mask_truncated, overlong_buffer, overlong_penalty, mismatch }
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    #: the optimiser and the update: { lr, weight_decay, max_grad_norm, lr_schedule, lr_warmup_steps, ppo_epochs,
    #: minibatches, micro_batch_size, max_tokens_per_micro_batch, gradient_checkpointing }
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    #: the training completions: { max_new_tokens, temperature, top_p }
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    #: held-out evaluation: { every, prompts, samples, temperature }
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    #: devices and ranks: { device, ref_device, world_size, rank_timeout_s, num_threads, nnodes, node_rank,
    #: master_addr, master_port } (the GPUs and CPUs themselves: [placement.trainer])
    devices: DevicesConfig = msgspec.field(default_factory=DevicesConfig)

    def __post_init__(self) -> None:
        loss, budget = self.loss, self.sampling.max_new_tokens
        if loss.aggregation == "seq_mean_token_sum_norm" and not loss.norm_tokens:
            if not budget:
                raise ConfigError("config key services.trainer.loss.aggregation is \"seq_mean_token_sum_norm\" (type "
                                  f"{loss.type!r}), whose normaliser is a constant: set services.trainer.loss."
                                  "norm_tokens or services.trainer.sampling.max_new_tokens")
            loss.norm_tokens = budget
        if loss.overlong_buffer:
            if not budget:
                raise ConfigError("config key services.trainer.loss.overlong_buffer needs the token limit it counts "
                                  "back from: set services.trainer.sampling.max_new_tokens")
            if loss.overlong_buffer > budget:
                raise ConfigError(f"config key services.trainer.loss.overlong_buffer ({loss.overlong_buffer}) is "
                                  f"more than services.trainer.sampling.max_new_tokens ({budget}): lower it")
        if self.optim.minibatches > self.groups_per_step * self.group_size:
            raise ConfigError(f"config key services.trainer.optim.minibatches is {self.optim.minibatches}, more "
                              f"than the {self.groups_per_step * self.group_size} completions of a batch "
                              "(groups_per_step x group_size): lower it")

    @property
    def max_groups_in_flight(self) -> int:
        return (self.max_staleness + 1) * self.groups_per_step
