"""The policy update: one GRPO step over a batch of scored trajectories, and checkpoints.

Runs in a worker thread of the trainer service (torch releases the GIL), so the
event loop keeps serving the bus while the step computes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from proto.trajectories import ScoredTrajectory
from services.lib.model_io import load_policy, save_policy, sequence_logprobs
from services.trainer.config import TrainerConfig
from services.trainer.loss import group_advantages, grpo_loss
from services.trainer.optim import build_lr_schedule, build_optimizer, optimizer_step

log = logging.getLogger("rlbus.trainer")


class CheckpointError(RuntimeError):
    pass


def completion_tensors(batch: list[ScoredTrajectory]) -> tuple[list[list[int]], list[list[int]], list[list[int]],
                                                                 list[list[float]]]:
    """Per trajectory: prompt ids, completion ids, loss mask (0 on tool tokens), behaviour logprobs."""
    prompts, completions, masks, behaviour = [], [], [], []
    for t in batch:
        ids: list[int] = []
        mask: list[int] = []
        blp: list[float] = []
        for turn in t.rollout.turns:
            ids += turn.token_ids
            if turn.role == "assistant":
                mask += [1] * len(turn.token_ids)
                lp = list(turn.logprobs) + [0.0] * (len(turn.token_ids) - len(turn.logprobs))
                blp += lp[: len(turn.token_ids)]
            else:
                mask += [0] * len(turn.token_ids)
                blp += [0.0] * len(turn.token_ids)
        prompts.append(list(t.rollout.prompt_ids))
        completions.append(ids)
        masks.append(mask)
        behaviour.append(blp)
    return prompts, completions, masks, behaviour


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


class Learner:
    """Owns the model, the optimiser and the schedule."""

    def __init__(self, cfg: TrainerConfig, model_dir: Path, device: str = "cpu") -> None:
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model, self.tokenizer = load_policy(model_dir, dtype=cfg.dtype, device=device)
        self.model.train()
        self.model.config.use_cache = False
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = build_lr_schedule(self.optimizer, cfg.lr_schedule, cfg.lr_warmup_steps,
                                           cfg.total_steps if cfg.lr_schedule != "constant" else None)
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model, _ = load_policy(model_dir, dtype=cfg.dtype, device=device)
            self.ref_model.eval().requires_grad_(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def step(self, batch: list[ScoredTrajectory]) -> dict[str, float]:
        """One optimiser step on whole groups; returns metrics named by path."""
        cfg = self.cfg
        t0 = time.perf_counter()
        rewards = torch.tensor([t.reward for t in batch], dtype=torch.float32)
        group_ids = [t.rollout.group_id for t in batch]
        # 1. group-normalised advantages, over whole groups
        advantages = group_advantages(rewards, group_ids, normalize_std=cfg.normalize_std)
        prompts, completions, masks, behaviour = completion_tensors(batch)
        if cfg.aggregation == "seq_mean_token_mean":
            total = float(sum(1 for m in masks if sum(m) > 0))
        else:
            total = float(sum(sum(m) for m in masks))
        sums: dict[str, float] = {}
        n_mb = 0
        # 2. micro-batches: logprobs under the current policy, loss, backward (accumulated)
        for lo in range(0, len(batch), cfg.micro_batch_size):
            hi = lo + cfg.micro_batch_size
            if total <= 0:
                break
            logprobs, loss_mask = sequence_logprobs(
                self.model, prompts[lo:hi], completions[lo:hi], completion_masks=masks[lo:hi],
                pad_token_id=self.pad_id, temperature=cfg.temperature)
            width = logprobs.shape[1]
            behaviour_lp = _pad(behaviour[lo:hi], width).to(logprobs.device)
            ref_lp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_lp, _ = sequence_logprobs(self.ref_model, prompts[lo:hi], completions[lo:hi],
                                                  completion_masks=masks[lo:hi], pad_token_id=self.pad_id,
                                                  temperature=cfg.temperature)
            loss, m = grpo_loss(
                logprobs, behaviour_lp, advantages[lo:hi].to(logprobs.device), loss_mask.to(logprobs.dtype),
                ref_logprobs=ref_lp, clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
                is_mode=cfg.is_mode, is_cap=cfg.is_cap, aggregation=cfg.aggregation, total=total)
            loss.backward()
            n_mb += 1
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        # 3. clip, step, schedule
        opt = optimizer_step(self.model, self.optimizer, self.scheduler, cfg.max_grad_norm) if n_mb else {}
        metrics = {k: (v if k.startswith("losses/") else v / max(n_mb, 1)) for k, v in sums.items()}
        metrics.update(opt)
        metrics["train/reward_mean"] = float(rewards.mean())
        metrics["train/completion_tokens_mean"] = float(sum(len(c) for c in completions) / len(completions))
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    # --- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> Path:
        """Atomically write ``root/step-<N>`` (HF model dir + optimiser + trainer state) and point ``latest`` at it."""
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{step:06d}"
        tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_policy(self.model, self.tokenizer, tmp)
        torch.save({
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        # keep the two newest checkpoints
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def latest_checkpoint(root: Path) -> Path | None:
        pointer = root / "latest"
        if not pointer.is_file():
            return None
        path = root / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise CheckpointError(f"checkpoint pointer {pointer} names {path}, which is incomplete")
        return path

    def load_optimizer(self, ckpt: Path) -> dict[str, Any]:
        blob = torch.load(ckpt / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        torch.set_rng_state(blob["rng"]["torch"])
        random.setstate(blob["rng"]["python"])
        return json.loads((ckpt / "trainer_state.json").read_text())
