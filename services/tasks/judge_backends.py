"""LLM-judge backends: where a judge model's verdicts come from, and how its text becomes a score.

:class:`services.tasks.graders.LlmJudgeGrader` asks a :class:`JudgeBackend` for a completion and turns it into
a score with :func:`parse_judge_score`; it does not care which model answers. The backends live here, apart
from the graders, because they are the part that grows (one per kind of judge model: the torch engine
in-process, an OpenAI-compatible endpoint, ...) and carries their dependencies (engines, HTTP).
:meth:`services.tasks.graders.GraderFactory.backend` is the one place that picks a backend for a judge spec.

* :func:`parse_judge_score` — a judge's free text → a score in [0, 1] (or :class:`JudgeParseError`);
* :class:`EngineJudgeBackend` — a judge on any :class:`services.lib.engine.base.Engine`;
* :class:`OpenAIJudgeBackend` — an OpenAI-compatible ``/chat/completions`` endpoint;
* :class:`JudgeCache` — verdicts by (rollout, rubric, judge), one judge call per key at a time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from proto.trajectories import GraderScore
from services.tasks.grader_specs import OpenAIJudgeModel, TorchJudgeModel, VllmJudgeModel


class JudgeParseError(ValueError):
    """The judge's output holds no usable score."""


class JudgeBackendError(RuntimeError):
    """The judge model could not be asked (endpoint down, bad reply)."""


_JSON_SCORE = re.compile(r'"score"\s*:\s*"?(-?\d+(?:\.\d+)?)')
_LABELLED = re.compile(r"(?:score|rating|grade)\s*(?:is|of|=|:)?\s*[*_`\"']*\s*(-?\d+(?:\.\d+)?)"
                       r"(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_BARE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*[.!]?\s*$")


def parse_judge_score(text: str, scale: float) -> tuple[float, str]:
    """A judge's output → (score in [0, 1], its explanation).

    Accepts ``Score: 7``, ``score = 7/10``, ``**Rating:** 7 out of 10``, ``{"score": 7}``, ``7/10`` or a bare
    ``7``. Raises :class:`JudgeParseError` (with the output quoted) when none is found or it is out of range.
    """
    found: tuple[str, str | None] | None = None
    for pattern in (_JSON_SCORE, _LABELLED, _FRACTION):
        m = pattern.search(text)
        if m is not None:
            found = (m.group(1), m.group(2) if pattern.groups > 1 else None)
            break
    if found is None:
        first = text.strip().splitlines()[0] if text.strip() else ""
        m = _BARE.match(first)
        if m is not None:
            found = (m.group(1), None)
    snippet = text.strip()[:200]
    if found is None:
        raise JudgeParseError(f"no score in the judge's output {snippet!r}")
    value, denominator = float(found[0]), float(found[1]) if found[1] else scale
    if denominator <= 0 or not 0 <= value <= denominator:
        raise JudgeParseError(f"score {found[0]} is outside 0..{denominator:g} in the judge's output {snippet!r}")
    explanation = re.sub(r"\s+", " ", text.strip())[:300]
    return value / denominator, explanation


Messages = list[dict[str, str]]


class JudgeBackend(Protocol):
    """Where judge completions come from."""

    identity: str

    async def complete(self, messages: Messages, max_tokens: int, prefill: str = "") -> str:
        """The judge's answer to ``messages``; backends that can start the answer with ``prefill`` do (and
        return it as part of the answer), others ignore it."""
        ...

    async def close(self) -> None:
        ...


class EngineJudgeBackend:
    """A judge on any :class:`services.lib.engine.base.Engine` (greedy), prompted through its chat template."""

    def __init__(self, engine: Any, tokenizer: Any, identity: str, *, owns_engine: bool = False) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.identity = identity
        self.owns_engine = owns_engine
        self._started = not owns_engine
        self._lock = asyncio.Lock()

    @classmethod
    def from_spec(cls, spec: TorchJudgeModel | VllmJudgeModel, seed: int = 0) -> EngineJudgeBackend:
        """A torch or vLLM engine for ``spec``, started on first use."""
        from services.tasks.models import resolve_model

        model_dir = resolve_model(spec.model, spec.cache_dir or None, seed=seed)
        if isinstance(spec, VllmJudgeModel):
            from services.lib.engine.config import VllmEngineConfig
            from services.lib.engine.vllm_engine import VllmEngine

            engine: Any = VllmEngine(VllmEngineConfig(
                dtype=spec.dtype, max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                gpu_memory_utilization=spec.gpu_memory_utilization, kv_cache_gib=spec.kv_cache_gib),
                model_dir, seed=seed)
            return cls(engine, None, f"vllm:{model_dir}", owns_engine=True)
        from services.lib.engine.config import TorchEngineConfig
        from services.lib.engine.torch_engine import TorchEngine

        engine = TorchEngine(TorchEngineConfig(dtype=spec.dtype, device=spec.device, max_batch_size=spec.max_batch_size,
                                               num_threads=spec.num_threads), model_dir)
        return cls(engine, None, f"torch:{model_dir}", owns_engine=True)

    async def complete(self, messages: Messages, max_tokens: int, prefill: str = "") -> str:
        from services.lib.engine.base import EngineError, SamplingParams
        from services.tasks.base import encode_chat, encode_text

        async with self._lock:
            if not self._started:
                await self.engine.start()
                self.tokenizer = self.engine.tokenizer
                self._started = True
        if getattr(self.tokenizer, "chat_template", None):
            ids = encode_chat(self.tokenizer, messages)
        else:  # a base model: a plain transcript ending where the judge answers
            ids = encode_text(self.tokenizer, "\n\n".join(f"{m['role'].capitalize()}: {m['content']}"
                                                          for m in messages) + "\n\nAssistant:")
        if prefill:  # the answer starts with it: small judges then write the number next
            ids += list(self.tokenizer.encode(prefill, add_special_tokens=False))
        try:
            result = await self.engine.generate(ids, SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
        except EngineError as e:
            raise JudgeBackendError(f"judge engine failed: {e}") from e
        return prefill + result.text

    async def close(self) -> None:
        if self.owns_engine and self._started:
            await self.engine.stop()


class OpenAIJudgeBackend:
    """An OpenAI-compatible ``/chat/completions`` endpoint (stdlib HTTP in a worker thread; greedy)."""

    def __init__(self, spec: OpenAIJudgeModel) -> None:
        self.spec = spec
        self.url = spec.base_url.rstrip("/") + "/chat/completions"
        self.identity = f"openai:{self.url}:{spec.model}"

    def _post(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.spec.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.spec.timeout_s) as resp:
            return resp.read()

    async def complete(self, messages: Messages, max_tokens: int, prefill: str = "") -> str:
        """``prefill`` is not sent: chat-completions endpoints have no portable way to start the answer."""
        body = json.dumps({"model": self.spec.model, "messages": messages, "temperature": 0.0,
                           "max_tokens": max_tokens}).encode()
        try:
            raw = await asyncio.to_thread(self._post, body)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise JudgeBackendError(f"POST {self.url} failed: {e}") from e
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeBackendError(f"{self.url} answered without choices[0].message.content: {raw[:200]!r}") from e
        return str(content or "")

    async def close(self) -> None:
        return None


class JudgeCache:
    """LRU of LLM-judge verdicts by key; concurrent requests for one key share a single judge call."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[str, GraderScore] = OrderedDict()
        self.pending: dict[str, asyncio.Future[GraderScore]] = {}
        self.hits = 0
        self.misses = 0

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[tuple[GraderScore, bool]]]) -> GraderScore:
        """The cached verdict, or ``compute()``'s (kept when its flag says it is cacheable)."""
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        if key in self.pending:
            self.hits += 1
            return await asyncio.shield(self.pending[key])
        self.misses += 1
        future: asyncio.Future[GraderScore] = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        try:
            score, cacheable = await compute()
        except Exception as e:  # the waiters get the same failure
            future.set_exception(e)
            future.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        else:
            future.set_result(score)
        finally:
            self.pending.pop(key, None)
            if not future.done():  # cancelled: so are the waiters
                future.cancel()
        if cacheable and self.max_entries > 0:
            self.entries[key] = score
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return score
