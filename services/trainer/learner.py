"""The policy update: one GRPO step over a batch of scored trajectories, on one rank or many.

Runs in a worker thread of the trainer service (torch releases the GIL), so the event loop keeps
serving the bus while the step computes.

One rank (``world_size = 1``): a plain model on its device. ``dtype = "bfloat16"`` is mixed
precision: the weights and AdamW's moments stay float32 (the master copy the optimiser updates)
and the forward/backward runs under ``torch.autocast`` in bf16.

Many ranks: every rank holds a :class:`Learner` whose model is sharded with FSDP2
(``fully_shard`` per decoder layer and on the root; bf16 mixed precision through FSDP's own
``MixedPrecisionPolicy``, gradients reduced in float32), loaded the large-model way
(:mod:`services.trainer.sharding`: rank 0 reads the checkpoint, the others build on the meta device and
receive their shards); the KL reference is sharded the same way on each rank's own device, and the weights
to publish are gathered tensor by tensor in the training dtype onto rank 0's device. Rank 0 alone talks to the bus. A Learner's
methods are this rank's work; each collective operation (a step, gathering the weights, a checkpoint) is
an :class:`~services.trainer.rank_ops.Op`, which :meth:`Learner.run_on_all_ranks` sends to the other
ranks (:mod:`services.trainer.ranks`) and then runs on this one, so every rank issues the same
collectives in the same order. A step sends the whole batch to every rank; each takes its share
(:mod:`services.trainer.batching`).

LoRA (``lora`` set): the model is wrapped with peft adapters (:mod:`services.trainer.lora`) before it is
sharded, only they train, :meth:`Learner.state_dict` is the adapter version engines merge (only the adapters
are gathered onto rank 0, never the frozen base), and the KL reference is the same model with its adapters disabled (the base), so
no second copy of the model is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from proto.trajectories import ScoredTrajectory
from services.lib.model_io import load_policy, sequence_logprobs
from services.lib.packing import packed_sequence_logprobs, use_varlen_attention
from services.runtime.config import DistillSection
from services.trainer import batching, checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.devices import Placement
from services.trainer.distill import pad_token_advantages
from services.trainer.loss import grpo_loss
from services.trainer.optim import build_lr_schedule, build_optimizer, optimizer_step
from services.trainer.rank_ops import OPS, Op
from services.trainer.sharding import gather, load_sharded
from services.trainer.step_input import StepInput, loss_total

log = logging.getLogger("rlbus.trainer")


class CheckpointError(RuntimeError):
    pass


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


class Learner:
    """Owns the model (this rank's shard of it), the optimiser and the schedule.

    ``group`` (rank 0 of many ranks only) is the :class:`~services.trainer.ranks.RankGroup` that
    :meth:`run_on_all_ranks` sends every collective operation to.
    """

    def __init__(self, cfg: TrainerConfig, model_dir: Path, placement: Placement | None = None, *,
                 rank: int = 0, init_method: str = "", group: Any = None, ref_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.placement = placement or Placement("cpu", "cpu", "gloo")
        self.rank, self.world_size = rank, cfg.devices.world_size
        self.group = group
        self.model_dir = Path(model_dir)
        if cfg.devices.num_threads:
            torch.set_num_threads(cfg.devices.num_threads)
        device = self.placement.device
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if self.world_size > 1 and not dist.is_initialized():
            from datetime import timedelta

            join = functools.partial(dist.init_process_group, self.placement.backend, init_method=init_method,
                                     rank=rank, world_size=self.world_size,
                                     timeout=timedelta(seconds=cfg.devices.rank_timeout_s))
            if group is not None:  # rank 0 stops waiting for the others as soon as one of them dies
                group.guarded(join)
            else:
                join()
        self.bf16 = self.placement.dtype == "bfloat16"
        self.lora = cfg.lora
        # float32 master weights; bf16 only in the forward/backward (autocast, or FSDP's policy). Many ranks:
        # rank 0 reads the checkpoint, the others build on the meta device and receive their shards
        if self.world_size > 1:
            self.model, self.tokenizer = load_sharded(self.model_dir, rank, device, bf16=self.bf16,
                                                      prepare=self._prepare)
        else:
            model, self.tokenizer = load_policy(model_dir, dtype="float32", device=device)
            self.model = self._prepare(model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        #: the sequences of a pass packed into rows (:mod:`services.lib.packing`) or right-padded
        self.logprobs = packed_sequence_logprobs if cfg.optim.packing else sequence_logprobs
        self.optimizer = build_optimizer(self.model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                         fused=self.placement.fused_optim)
        self.scheduler = build_lr_schedule(self.optimizer, cfg.optim.lr_schedule, cfg.optim.lr_warmup_steps,
                                           cfg.total_steps if cfg.optim.lr_schedule != "constant" else None)
        self.ref_model = None
        #: the reference is sharded like the policy (on each rank's own device), so every rank runs its forward
        self.ref_sharded = False
        if cfg.loss.kl_coef > 0 and self.lora is None:  # with LoRA the reference is the base: adapters disabled
            # the initial policy (``ref_dir``), also when the policy itself comes from a checkpoint
            ref_path = Path(ref_dir or model_dir)
            if self.world_size > 1 and self.placement.ref_device == device:
                self.ref_model, _ = load_sharded(ref_path, rank, device, bf16=False, dtype=self.placement.dtype)
                self.ref_sharded = True
            else:
                self.ref_model, _ = load_policy(ref_path, dtype=self.placement.dtype, device=self.placement.ref_device)
            self.ref_model.eval().requires_grad_(False)

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """LoRA adapters (if set), train mode, activation checkpointing: before the model is sharded."""
        if self.lora is not None:
            from services.trainer.lora import apply_lora

            model = apply_lora(model, self.lora)
        model.train()
        model.config.use_cache = False
        if (self.cfg.optim.packing and self.cfg.optim.varlen_attention and self.placement.device_type == "cpu"
                and not use_varlen_attention(model)):
            log.info("attention stays %s: this model cannot take the per-sequence attention of packed rows",
                     getattr(model.config, "_attn_implementation", "its own"))
        if self.cfg.optim.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.bf16 and self.world_size == 1:
            return torch.autocast(self.placement.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def run_on_all_ranks(self, op: Op, *args: Any, others: tuple[Any, ...] | None = None) -> Any:
        """Run ``op`` (:mod:`services.trainer.rank_ops`) on every rank: rank 0 sends it to the others first, with
        ``args`` or ``others`` (what they get instead: tensors only rank 0 holds); returns rank 0's result."""
        fn = OPS[op]
        if self.group is None:
            return fn(self, *args)
        self.group.send(op, *(args if others is None else others))
        return self.group.guarded(self._on_device, fn, self, *args)

    def _on_device(self, fn: Any, *args: Any) -> Any:
        if self.placement.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.placement.device))  # per thread
        return fn(*args)

    # --- the step -------------------------------------------------------------------------------

    def step(self, batch: list[ScoredTrajectory], distill: DistillSection | None = None) -> dict[str, float]:
        """One optimiser step on whole groups (``distill``: on-policy distillation's per-token advantages);
        returns metrics named by path."""
        return self.run_on_all_ranks(Op.STEP, StepInput.of(batch, self.cfg, distill))

    def step_input(self, inp: StepInput) -> dict[str, float]:
        """This rank's part of one step (every rank calls it with the same input).

        ``ppo_epochs`` passes over the batch, each cut into ``minibatches`` optimiser updates. With more
        than one update, the proximal policy's logprobs (the weights before the first update) are computed
        once, and every update's PPO ratio is taken against them (decoupled PPO); the lr schedule advances
        once per batch."""
        t0 = time.perf_counter()
        cfg = self.cfg
        updates = cfg.optim.ppo_epochs * cfg.optim.minibatches
        every_row = list(range(len(inp.completions)))
        parts = batching.minibatches(inp.lengths, cfg.optim.minibatches) if updates > 1 else [every_row]
        # 1. the proximal policy (several updates only; one update takes the ratio against itself)
        prox = self.proximal_logprobs(inp, parts) if updates > 1 else None
        t_prox = time.perf_counter() - t0
        sums: dict[str, float] = {}
        n_mb = 0
        opts: list[dict[str, float]] = []
        for _ in range(cfg.optim.ppo_epochs):
            for rows in parts:
                # 2. forward/backward over the minibatch's micro-batches (gradients accumulate)
                part_sums, part_mb, passes = self.accumulate(inp, rows, prox)
                n_mb += part_mb
                for k, v in part_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
                # 3. clip and step
                if passes:
                    opts.append(optimizer_step(self.model, self.optimizer, None, cfg.optim.max_grad_norm))
        if opts:
            self.scheduler.step()
        # a minibatch's losses add up over its passes; the other metrics are means over every pass
        metrics = {k: (v / len(opts) if k.startswith("losses/") else v / max(n_mb, 1)) for k, v in sums.items()}
        if opts:
            metrics["optim/grad_norm"] = sum(o["optim/grad_norm"] for o in opts) / len(opts)
            metrics["optim/lr"] = opts[0]["optim/lr"]
            metrics["optim/skipped"] = sum(o["optim/skipped"] for o in opts)
        if updates > 1:
            metrics["optim/updates"] = float(len(opts))
            metrics["time/proximal_s"] = t_prox
        metrics["train/reward_mean"] = sum(inp.rewards) / max(len(inp.rewards), 1)
        metrics["train/completion_tokens_mean"] = sum(len(c) for c in inp.completions) / max(len(inp.completions), 1)
        # rows are sequences: an episode of several segments (a black-box agent that rewrote its history) has several
        metrics["train/sequences"] = float(len(inp.completions))
        metrics["train/episodes"] = float(len(inp.rewards))
        metrics.update(inp.figures)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _passes(self, inp: StepInput, rows: list[int], total: float) -> list[list[int]]:
        """This rank's micro-batches of ``rows`` (indices into the batch); as many as every other rank's."""
        if total <= 0:
            return []
        lengths = inp.lengths
        plan = batching.plan([lengths[i] for i in rows], self.world_size, self.cfg.optim.micro_batch_size,
                             self.cfg.optim.max_tokens_per_micro_batch)[self.rank]
        return [[rows[j] for j in p] for p in plan]

    def proximal_logprobs(self, inp: StepInput, parts: list[list[int]]) -> dict[int, torch.Tensor]:
        """The current policy's logprobs of this rank's rows of ``parts``, without gradient: one 1-D tensor per
        row (its completion's tokens), taken before the batch's first update."""
        prox: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for rows in parts:
                total = loss_total(inp.masks, rows, str(self.cfg.loss.aggregation), inp.episode_tokens)
                for p in self._passes(inp, rows, total):
                    if not p:  # join the other ranks' collectives
                        with self._autocast():
                            ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.placement.device)
                            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                        continue
                    with self._autocast():
                        lp, _ = self.logprobs(
                            self.model, [inp.prompts[i] for i in p], [inp.completions[i] for i in p],
                            completion_masks=[inp.masks[i] for i in p], pad_token_id=self.pad_id,
                            temperature=self.cfg.sampling.temperature)
                    for k, i in enumerate(p):
                        prox[i] = lp[k, : len(inp.completions[i])].float()
        return prox

    def accumulate(self, inp: StepInput, rows: list[int] | None = None,
                   prox: dict[int, torch.Tensor] | None = None) -> tuple[dict[str, float], int, int]:
        """2. This rank's micro-batches of ``rows`` (default: the whole batch): logprobs under the current
        policy, loss (normalised by the rows' total), backward (gradients accumulate). ``prox``: proximal
        logprobs per row (see :meth:`proximal_logprobs`). Returns the loss metrics summed over every rank's
        passes, the number of passes with rows (all ranks), and this rank's number of passes."""
        if rows is None:
            rows, total = list(range(len(inp.completions))), inp.total
        else:
            total = loss_total(inp.masks, rows, str(self.cfg.loss.aggregation), inp.episode_tokens)
        passes = self._passes(inp, rows, total)
        sums: dict[str, float] = {}
        n_mb = 0
        for p in passes:
            if not p:  # this rank has fewer passes than another: join the collectives, add nothing
                self._empty_pass()
                continue
            m = self._pass(inp, p, total, prox)
            n_mb += 1
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (sums, n_mb))
            sums, n_mb = {}, 0
            for part, n in gathered:
                n_mb += n
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + v
        return sums, n_mb, len(passes)

    def _pass(self, inp: StepInput, rows: list[int], total: float,
              prox: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
        cfg, lc = self.cfg, self.cfg.loss
        prompts = [inp.prompts[i] for i in rows]
        completions = [inp.completions[i] for i in rows]
        masks = [inp.masks[i] for i in rows]
        with self._autocast():
            logprobs, loss_mask = self.logprobs(
                self.model, prompts, completions, completion_masks=masks, pad_token_id=self.pad_id,
                temperature=cfg.sampling.temperature)
        width = logprobs.shape[1]
        behaviour_lp = _pad([inp.behaviour[i] for i in rows], width).to(logprobs.device)
        old_lp = None
        if prox is not None:
            old_lp = torch.zeros((len(rows), width), dtype=torch.float32, device=logprobs.device)
            for k, i in enumerate(rows):
                old_lp[k, : prox[i].shape[0]] = prox[i][:width]
        ref_lp = None
        if cfg.loss.kl_coef > 0:
            ref_model = self.ref_model if self.ref_model is not None else self.model
            base = self.model.disable_adapter() if self.ref_model is None else contextlib.nullcontext()
            with torch.no_grad(), base:
                ref_lp, _ = self.logprobs(ref_model, prompts, completions, completion_masks=masks,
                                              pad_token_id=self.pad_id, temperature=cfg.sampling.temperature)
            ref_lp = ref_lp.to(logprobs.device)
        if inp.token_advantages:  # on-policy distillation: one advantage per token
            advantages = pad_token_advantages([inp.token_advantages[i] for i in rows], width, logprobs.device)
        else:
            advantages = torch.tensor([inp.advantages[i] for i in rows], dtype=torch.float32, device=logprobs.device)
        weights = torch.tensor([inp.weights[i] for i in rows], dtype=torch.float32,
                               device=logprobs.device) if inp.weights else None
        episode_tokens = torch.tensor([inp.episode_tokens[i] for i in rows], dtype=torch.float32,
                                      device=logprobs.device) if inp.episode_tokens else None
        loss, m = grpo_loss(  # loss_mask: the step's own masks (loss.mask_truncated) on the model's padding
            logprobs, behaviour_lp, advantages, loss_mask.to(logprobs.dtype), old_logprobs=old_lp, ref_logprobs=ref_lp,
            sample_weights=weights, loss_type=lc.type, clip_low=lc.clip_low, clip_high=lc.clip_high,
            kl_coef=lc.kl_coef, is_mode=lc.is_mode, is_cap=lc.is_cap, is_floor=lc.is_floor,
            mismatch_mask=lc.mismatch.mask, mismatch_low=lc.mismatch.low, mismatch_high=lc.mismatch.high,
            aggregation=lc.aggregation or "seq_mean_token_mean", norm_tokens=float(lc.norm_tokens), total=total,
            episode_tokens=episode_tokens)
        # FSDP averages gradients over ranks; every rank's loss is already a share of the whole batch's
        (loss * self.world_size).backward()
        return m

    def _empty_pass(self) -> None:
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.placement.device)
        with self._autocast():
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if self.ref_sharded:  # the sharded reference's forward is a collective too: between the policy's
            with torch.no_grad():  # forward and backward, as in a pass with rows
                self.ref_model(input_ids=ids, use_cache=False, logits_to_keep=1)
        (out.logits.float().sum() * 0.0).backward()

    # --- weights --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (in the training dtype), to send to the engines.

        Many ranks: gathered one tensor at a time, cast to the training dtype on the shard first, onto rank 0's
        device (the other ranks hold nothing more than their shards); with LoRA the adapters only."""
        return self.run_on_all_ranks(Op.STATE_DICT)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """:meth:`state_dict` with no tensor sharing memory with the model: what the next step (updating the
        weights in place) cannot change while the version is still being sent. Tensors the state dict already
        made (a bf16 cast, a gather onto rank 0, LoRA's wire form) are not copied again."""
        sd = self.state_dict()
        if self.world_size > 1:  # gathered onto rank 0: new tensors already (FSDP's own are DTensors)
            return sd
        live = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}
        return {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in sd.items()}

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict: its own on one rank; on many, gathered onto rank 0's host memory
        (every rank calls this; the others get nothing)."""
        if self.world_size == 1:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def gather_weights(self, dtype: torch.dtype | None = None, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Many ranks: the full tensors on rank 0's device, gathered one at a time, each cast to ``dtype`` on its
        shard first; ``adapters_only``: LoRA's adapter tensors, not the frozen base (every rank calls this)."""
        return gather(self.model, self.rank, dtype=dtype, keep=(lambda k: "lora_" in k) if adapters_only else None)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights with ``state_dict`` (full tensors on rank 0; the others receive them)."""
        if self.lora is not None:  # checked before any rank starts loading
            from services.lib.weights.lora_merge import is_adapter
            from services.trainer.lora import check_fits, peft_keys

            if not is_adapter(state_dict):
                raise CheckpointError("lora is set but the weights to load are a full state dict, not an adapter "
                                      "version (did this run train without lora before?): remove lora, or start "
                                      "a fresh run")
            check_fits(self.model.state_dict(), state_dict)
            state_dict = peft_keys(state_dict, "default")  # the wrapped model's own names
        self.run_on_all_ranks(Op.LOAD_WEIGHTS, state_dict, others=({},))

    def save_pretrained(self, out: Path) -> Path:
        """The model as a Hugging Face directory (float32 master weights), written by rank 0; with LoRA the
        adapters merged in."""
        self.run_on_all_ranks(Op.SAVE_HF, str(out))
        return out

    def save_adapter(self, out: Path) -> Path:
        """LoRA only: the adapters as a peft directory (``adapter_config.json`` + safetensors), by rank 0."""
        if self.lora is None:
            raise CheckpointError("save_adapter needs lora: this learner trains every weight")
        self.run_on_all_ranks(Op.SAVE_ADAPTER, str(out))
        return out

    # --- checkpoints (services/trainer/checkpoint.py) --------------------------------------------

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> Path:
        """Atomically write ``root/step-<N>`` with every rank and point ``latest`` at it."""
        tmp = checkpoint.staging(root, step)
        self.run_on_all_ranks(Op.WRITE_CHECKPOINT, str(tmp))
        return checkpoint.commit(self, tmp, trainer_state)

    @staticmethod
    def latest_checkpoint(root: Path) -> Path | None:
        pointer = root / "latest"
        if not pointer.is_file():
            return None
        path = root / pointer.read_text().strip()
        if not path.exists() and (root / f".old-{path.name}").is_dir():  # stopped between commit's two renames
            path = root / f".old-{path.name}"
        if not (path / "trainer_state.json").is_file():
            raise CheckpointError(f"checkpoint pointer {pointer} names {path}, which is incomplete")
        return path

    def load_optimizer(self, ckpt: Path) -> dict[str, Any]:
        """Model and optimiser state of ``ckpt`` (written by any number of ranks); returns the trainer state."""
        self.run_on_all_ranks(Op.READ_CHECKPOINT, str(ckpt))
        return checkpoint.trainer_state(ckpt)
