"""The inference-engine contract of the rollout service.

Agent loops (hundreds of coroutines in one process) call :meth:`Engine.generate`
concurrently; an engine batches them however it likes. Every result carries,
per generated token, the behaviour logprob and the weight version that produced
it, which is what the trainer's off-policy correction and staleness filter need.

Conventions every engine follows:

* **Logprobs** are ``log_softmax(logits / T)`` of the chosen token, i.e. of the
  *temperature-scaled* distribution over the full vocabulary (top-p truncation
  is not folded in). With ``temperature == 0`` (greedy) the logprob is that of
  the unscaled distribution (``T = 1``).
* **Versions**: ``versions[i]`` is :attr:`Engine.version` at the moment token
  ``i`` was sampled. With in-flight updates one sequence may mix versions.
* **Stops**: ``token_ids`` keep every generated token, including the EOS or stop
  token and the tokens that completed a stop string; ``text`` omits special
  tokens and ends *before* a matched stop string.

At the end are small helpers any engine may use: :func:`resolve_threadsafe` (an
engine thread answering a coroutine's future) and :class:`TokenRate` (the
tokens/s figure of :class:`EngineStats`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is only needed by engines, not by users of the types
    import torch

log = logging.getLogger("rlbus.engine")

FinishReason = Literal["stop", "length", "eos"]
WeightUpdateMode = Literal["in_flight", "between_requests"]
"""When new weights take effect: between two decode steps, with requests still
running (``in_flight``), or only once no request is running (``between_requests``;
new requests wait meanwhile)."""


class EngineError(Exception):
    """Base class of inference-engine errors."""


class EngineNotRunningError(EngineError):
    """The engine is not started, or was stopped while the request waited."""


class EngineOverloadedError(EngineError):
    """The request queue is full; the caller should apply back-pressure and retry."""


class InvalidRequestError(EngineError, ValueError):
    """A request or its sampling parameters cannot be served as given."""


class WeightUpdateError(EngineError):
    """A weight update does not match the model; nothing was applied."""


@dataclass
class SamplingParams:
    """How to sample one completion."""

    max_new_tokens: int
    """Upper bound on generated tokens (finish reason ``length``)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends once the decoded text contains one (finish reason ``stop``)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (finish reason ``stop``); the token is kept."""
    seed: int | None = None
    """Seed of this request's own generator: same prompt, params and weights give the same tokens
    whatever else is in the batch (up to floating-point differences of batched kernels)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token(s) (benchmarks, fixed-length rollouts)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")


@dataclass
class GenerationResult:
    """One finished completion."""

    token_ids: list[int]
    """Generated tokens (prompt excluded), including any EOS/stop token."""
    logprobs: list[float]
    """Per token: log-probability under the temperature-scaled distribution it was sampled from."""
    versions: list[int]
    """Per token: the engine's weight version when it was sampled."""
    finish_reason: FinishReason
    """``eos`` (model EOS), ``stop`` (stop token or string) or ``length`` (max_new_tokens)."""
    text: str
    """Decoded completion without special tokens, cut before a matched stop string."""


@dataclass
class EngineStats:
    """A snapshot of an engine's load, for metrics and flow control."""

    pending: int
    """Requests not finished yet: queued + running."""
    running: int
    """Requests in the running batch."""
    tokens_per_s: float
    """Generated tokens per second over a recent window."""
    total_generated_tokens: int
    """Tokens generated since start."""
    version: int
    """Current weight version."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine shared by many concurrent agent loops in one event loop."""

    async def start(self) -> None:
        """Load the model and start serving."""
        ...

    async def stop(self) -> None:
        """Stop serving; requests still pending fail with :class:`EngineNotRunningError`."""
        ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one completion of ``prompt_ids``."""
        ...

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model and set :attr:`version`; returns once applied.

        Applied between two decode steps (``in_flight``) or once no request runs
        (``between_requests``), according to the engine's configuration. Every transport sends whole
        state dicts; a partial one must hold whole layers (vLLM rebuilds a fused layer, e.g. q/k/v,
        from the tensors given). A refused update raises and leaves the version unchanged.
        """
        ...

    @property
    def version(self) -> int:
        """The weight version tokens are sampled with now."""
        ...

    def stats(self) -> EngineStats:
        """Current load figures."""
        ...


# --- helpers for engines ----------------------------------------------------------------------------------


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def resolve_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
                       error: BaseException | None = None) -> None:
    """From any thread, complete ``future`` (of ``loop``) with ``result`` or ``error``, on ``loop`` itself.

    A future already done (cancelled by its caller) stays as it is; if ``loop`` is closed, nobody is waiting
    any more and the result is dropped.
    """
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the caller's event loop is closed
        log.debug("dropping a result for a closed event loop")


class TokenRate:
    """Generated tokens: the total, and the rate over the last ``window_s`` seconds (not locked: callers do)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, n: int, now: float) -> None:
        """Count ``n`` tokens generated at ``now`` (``time.monotonic()``)."""
        self.total += n
        self._recent.append((now, n))
        self._forget(now)

    def per_s(self, now: float) -> float:
        """Tokens per second over the window ending at ``now`` (or since the first token, if more recent)."""
        self._forget(now)
        recent = sum(n for _, n in self._recent)
        span = min(self.window_s, now - self._recent[0][0]) if self._recent else self.window_s
        return recent / span if span > 0 else 0.0

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
