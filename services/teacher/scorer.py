"""The teacher's side of on-policy distillation: logprobs of given tokens under a model, and the check that
teacher and student share one tokenizer (the student's token ids are scored as they are, so a different
vocabulary would score other text)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from proto.teacher import TeacherSequence
from services.lib.model_io import load_policy, sequence_logprobs
from services.runtime.config import ConfigError


def tokenizer_difference(teacher: Any, student: Any) -> str:
    """How two tokenizers differ in what distillation relies on (the id of every token, the special tokens), or
    ``""`` when they do not."""
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        only_t, only_s = sorted(set(tv) - set(sv)), sorted(set(sv) - set(tv))
        moved = sorted(k for k in set(tv) & set(sv) if tv[k] != sv[k])
        parts = [f"{len(tv)} vs {len(sv)} tokens"]
        if only_t:
            parts.append(f"only the teacher's: {only_t[:5]!r}")
        if only_s:
            parts.append(f"only the student's: {only_s[:5]!r}")
        if moved:
            parts.append(f"other ids for {moved[:5]!r}")
        return "; ".join(parts)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(teacher, name, None) != getattr(student, name, None):
            return f"{name} {getattr(teacher, name, None)} vs {getattr(student, name, None)}"
    return ""


def check_same_tokenizer(teacher: Any, student: Any, teacher_key: str, student_key: str) -> None:
    """Raise :class:`ConfigError` naming both keys when the teacher's tokenizer is not the student's."""
    diff = tokenizer_difference(teacher, student)
    if diff:
        raise ConfigError(f"config keys {teacher_key} and {student_key}: the teacher's tokenizer differs from the "
                          f"student's ({diff}); distillation scores the student's token ids with the teacher, so "
                          "both must use one tokenizer")


class TeacherScorer:
    """A causal LM that scores token sequences; :meth:`score` is blocking (run it in a thread) and serialised."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 max_batch_size: int = 32) -> None:
        self.model, self.tokenizer = load_policy(model_dir, dtype=dtype, device=device)  # type: ignore[arg-type]
        self.model.eval()
        self.identity = str(model_dir)
        self.max_batch_size = max_batch_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._lock = threading.Lock()

    def score(self, sequences: list[TeacherSequence], temperature: float = 1.0) -> list[list[float]]:
        """``log p(completion[j] | prompt, completion[:j])`` for every token of every sequence, in order.

        Raises:
            ValueError: a sequence has an empty prompt, a token id outside the teacher's vocabulary, or the
                temperature is not positive.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        vocab = self.model.get_input_embeddings().num_embeddings
        for i, s in enumerate(sequences):
            if not s.prompt_ids:
                raise ValueError(f"sequence {i} has an empty prompt")
            bad = next((t for t in (*s.prompt_ids, *s.completion_ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"sequence {i} has token id {bad}, outside the teacher's vocabulary of {vocab}")
        out: list[list[float]] = []
        with self._lock, torch.no_grad():
            for start in range(0, len(sequences), self.max_batch_size):
                chunk = sequences[start:start + self.max_batch_size]
                logprobs, _ = sequence_logprobs(self.model, [s.prompt_ids for s in chunk],
                                                [s.completion_ids for s in chunk], pad_token_id=self.pad_id,
                                                temperature=temperature)
                rows = logprobs.float().cpu()
                out.extend(rows[k, : len(s.completion_ids)].tolist() for k, s in enumerate(chunk))
        return out
