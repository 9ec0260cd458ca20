"""Per-request decoding for the torch engine: batched sampling, stop conditions, incremental text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.lib.engine.base import FinishReason, GenerationResult, SamplingParams


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row beyond its nucleus ``top_p`` (rows with top_p == 1 untouched)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_probs = sorted_probs.masked_fill(remove, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, list[int], list[float]]:
    """Sample one token per row of ``logits`` ``[B, V]``.

    Sampling is by inverse CDF (one uniform per row, ``searchsorted`` on the
    cumulative probabilities: cheaper than ``torch.multinomial`` or Gumbel noise
    over the vocabulary); rows with their own generator (a seed) draw their
    uniform from it, so a seeded request's tokens do not depend on its batch
    neighbours. ``temperature == 0``
    rows take the argmax.

    Returns the tokens (tensor on the logits' device), and as Python lists the
    tokens and their logprobs ``log_softmax(logits / T)`` (``T = 1`` for greedy
    rows) — the temperature-scaled distribution, before top-p truncation.
    """
    logits = logits.float()
    temps = [p.temperature for p in params]
    greedy_rows = [t == 0.0 for t in temps]
    if all(t in (0.0, 1.0) for t in temps):
        scaled = logits
    else:
        temp = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=logits.dtype, device=logits.device)
        scaled = logits / temp[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    if all(greedy_rows):
        tokens = logits.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
            probs = _top_p_filter(probs, top_p)
        # inverse-CDF draw: first token whose cumulative mass exceeds u * total (zero-mass tokens never win)
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand((probs.shape[0], 1), generator=default_generator, device=probs.device)
        for i, generator in enumerate(generators):
            if generator is not None:
                uniform[i] = torch.rand((1,), generator=generator, device=probs.device)
        tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
        tokens = tokens.clamp_(max=probs.shape[-1] - 1)
        if any(greedy_rows):
            greedy = torch.tensor(greedy_rows, device=logits.device)
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, tokens.tolist(), chosen.tolist()


class IncrementalDetokenizer:
    """Text of a growing token list, decoded a few tokens at a time.

    Decodes ``tokens[prefix:]`` against ``tokens[prefix:read]`` (the scheme of
    TGI/vLLM), so multi-token characters and leading-space rules come out as in a
    full decode; text is released only once it does not end in U+FFFD.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0
        self._read = 0
        self._searched = 0

    def push(self, tokens: list[int]) -> None:
        """Account for tokens appended to ``tokens`` since the last call."""
        decode = self.tokenizer.decode
        prefix_text = decode(tokens[self._prefix : self._read], skip_special_tokens=True)
        new_text = decode(tokens[self._prefix :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(tokens)

    def find_stop(self, stops: Sequence[str]) -> int | None:
        """Index in :attr:`text` where the earliest stop string starts, if one has appeared."""
        start = max(0, self._searched - max(len(s) for s in stops) + 1)
        found = [i for i in (self.text.find(s, start) for s in stops) if i >= 0]
        self._searched = len(self.text)
        return min(found) if found else None


class DecodeState:
    """One request's prompt, generated tokens with logprobs and versions, and stop conditions.

    Stop strings: the tokens up to and including the one that completed the stop
    string are kept (the trainer needs every sampled token); the text ends before it.
    """

    __slots__ = ("prompt_ids", "params", "tokens", "logprobs", "versions", "generator", "stop_ids",
                 "eos_ids", "tokenizer", "detok", "finish_reason", "stop_text_end")

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_ids: frozenset[int],
                 tokenizer: Any | None, device: torch.device) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer) if params.stop and tokenizer is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_text_end: int | None = None

    def accept(self, token: int, logprob: float, version: int) -> bool:
        """Record a sampled token; True once the request is finished (see :attr:`finish_reason`)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.detok is not None:
            self.detok.push(self.tokens)
            end = self.detok.find_stop(self.params.stop)
            if end is not None:
                self.finish_reason, self.stop_text_end = "stop", end
        if self.finish_reason is None and len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        """The finished completion."""
        if self.stop_text_end is not None:
            text = self.detok.text[: self.stop_text_end]
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        else:
            text = ""
        return GenerationResult(token_ids=self.tokens, logprobs=self.logprobs, versions=self.versions,
                                finish_reason=self.finish_reason or "length", text=text)
