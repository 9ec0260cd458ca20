"""Graders: composable, weighted scorers of finished rollouts (configured per task, see ``config.py``).

* :class:`RewardGrader` — the task's reward function on the assistant's text;
* :class:`SandboxTestsGrader` — forks the rollout's sandbox, runs the task's hidden tests in the fork and
  scores the share that passed; the rollout's own sandbox is never touched and the fork is destroyed;
* :class:`LlmJudgeGrader` — a judge model (the torch engine in-process, or an OpenAI-compatible endpoint)
  rates the transcript against a rubric; malformed judge output is a recorded parse failure, not a crash;
  results are cached per (rollout, rubric, judge).

Every grader returns a :class:`proto.trajectories.GraderScore` (score in [0, 1], weight, explanation, error)
and never raises for a failure of what it grades with; :func:`grade_all` runs them concurrently and combines
them into the reward (weighted mean).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec

from proto import sandbox as api
from proto.rollouts import Rollout
from proto.trajectories import GraderScore
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.tasks.base import Prompt
from services.tasks.grader_specs import (
    GraderSpec,
    LlmJudgeSpec,
    OpenAIJudgeModel,
    RewardGraderSpec,
    SandboxTestsSpec,
    TorchJudgeModel,
)

log = logging.getLogger("rlbus.judge.graders")

#: the line a hidden-test runner prints last: ``RLBUS-TESTS {"passed": k, "total": n, "failures": [...]}``
TEST_REPORT_PREFIX = "RLBUS-TESTS "


# --- what tasks provide ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HiddenTests:
    """A task's hidden tests for one prompt, run in a fork of the rollout's sandbox.

    ``files`` are written into the fork; ``command`` runs with ``stdin`` (keep expected answers there, not on
    disk, where the graded code could read them). The run is scored from its last
    ``RLBUS-TESTS {json}`` line (``passed`` of ``total``), else by exit code (0 passes).
    """

    command: list[str]
    files: dict[str, bytes] = field(default_factory=dict)
    stdin: bytes = b""
    timeout_s: float = 30.0


@runtime_checkable
class TestedTask(Protocol):
    """A task with hidden tests (for :class:`SandboxTestsGrader`)."""

    def hidden_tests(self, prompt: Prompt) -> HiddenTests:
        ...


def prompt_of(rollout: Rollout) -> Prompt:
    """The task prompt a rollout answered, as far as the rollout carries it."""
    return Prompt(id=rollout.prompt_id, text=rollout.prompt_text, metadata=dict(rollout.metadata))


def assistant_text(rollout: Rollout) -> str:
    """The policy's own words: assistant turns joined by newlines (a single-turn rollout's completion)."""
    return "\n".join(t.text for t in rollout.turns if t.role == "assistant")


class Grader(Protocol):
    """Scores one rollout; failures are returned as a GraderScore with ``error`` set, not raised."""

    name: str
    spec: GraderSpec

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        ...


def _failed(grader: Grader, error: str, explanation: str = "") -> GraderScore:
    return GraderScore(grader=grader.name, score=0.0, weight=grader.spec.weight, error=error, explanation=explanation)


async def grade_all(graders: Sequence[Grader], rollout: Rollout, task: Any) -> tuple[float, list[GraderScore]]:
    """Every grader's score (concurrently) and their weighted mean; failed graders count per ``on_error``."""
    scores = list(await asyncio.gather(*(g.grade(rollout, task) for g in graders)))
    total = weight = 0.0
    for g, s in zip(graders, scores, strict=True):
        if s.error is not None and g.spec.on_error == "skip":
            continue
        total += s.weight * s.score
        weight += s.weight
    return (total / weight if weight > 0 else 0.0), scores


# --- reward functions ------------------------------------------------------------------------------------


class RewardGrader:
    """The task's reward function (what single-turn tasks always used)."""

    def __init__(self, spec: RewardGraderSpec, task_name: str) -> None:
        self.spec = spec
        self.name = spec.name or f"{task_name}.reward"

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        r = task.reward(prompt_of(rollout), assistant_text(rollout))
        return GraderScore(grader=self.name, score=float(r.value), weight=self.spec.weight, explanation=r.explanation)


# --- hidden tests in a fork ------------------------------------------------------------------------------


def score_test_run(reply: api.ExecReply) -> tuple[float, str]:
    """Score and explanation of a hidden-test run: its ``RLBUS-TESTS`` report, else its exit code."""
    if reply.timed_out:
        return 0.0, f"hidden tests timed out after {reply.duration_s:.1f} s"
    if reply.oom_killed:
        return 0.0, "hidden tests ran out of memory"
    lines = reply.stdout.decode("utf-8", errors="replace").splitlines()
    for line in reversed(lines):
        if line.startswith(TEST_REPORT_PREFIX):
            try:
                report = json.loads(line[len(TEST_REPORT_PREFIX):])
                passed, total = int(report["passed"]), int(report["total"])
            except (ValueError, KeyError, TypeError):
                break
            if total <= 0 or not 0 <= passed <= total:
                break
            why = "; ".join(str(f) for f in report.get("failures", [])[:3])
            return passed / total, f"{passed}/{total} hidden tests passed" + (f"; {why}" if why else "")
    stderr = reply.stderr.decode("utf-8", errors="replace").strip().splitlines()[-3:]
    ok = reply.exit_code == 0
    return (1.0 if ok else 0.0), f"hidden tests exited with {reply.exit_code}" + (
        f": {' | '.join(stderr)}" if stderr and not ok else "")


class SandboxTestsGrader:
    """Hidden tests in a fork of the rollout's sandbox (the original stays as the rollout left it)."""

    def __init__(self, spec: SandboxTestsSpec, sandboxes: SandboxClient) -> None:
        self.spec = spec
        self.name = spec.name or "sandbox_tests"
        self.sandboxes = sandboxes

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        if rollout.sandbox_id is None:
            return _failed(self, "the rollout has no sandbox to test (a single-turn task, or it failed before one "
                                 "was created)")
        if not isinstance(task, TestedTask):
            return _failed(self, f"task {rollout.task!r} has no hidden_tests(prompt); configure another grader")
        tests = task.hidden_tests(prompt_of(rollout))
        timeout = self.spec.timeout_s or tests.timeout_s
        try:
            fork = await self.sandboxes.fork(sandbox_id=rollout.sandbox_id, lease_ttl_s=self.spec.fork_lease_s,
                                             labels={"role": "hidden-tests", "rollout": rollout.msg_id})
        except SandboxClientError as e:
            return _failed(self, f"could not fork sandbox {rollout.sandbox_id}: {e}")
        try:
            if tests.files:
                await self.sandboxes.write_files(fork.sandbox_id, tests.files)
            reply = await self.sandboxes.exec(fork.sandbox_id, tests.command, stdin=tests.stdin, timeout_s=timeout)
        except SandboxClientError as e:
            return _failed(self, f"hidden tests could not run in fork {fork.sandbox_id}: {e}")
        finally:
            try:
                await self.sandboxes.destroy(fork.sandbox_id)
            except SandboxClientError as e:
                log.warning("fork %s not destroyed (%s); its lease will expire", fork.sandbox_id, e)
        score, why = score_test_run(reply)
        return GraderScore(grader=self.name, score=score, weight=self.spec.weight, explanation=why)


# --- LLM-as-judge ----------------------------------------------------------------------------------------


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
    def from_spec(cls, spec: TorchJudgeModel, seed: int = 0) -> EngineJudgeBackend:
        """A torch engine for ``spec``, loaded on first use (in a worker thread)."""
        from services.lib.engine.torch_engine import TorchEngine, TorchEngineConfig
        from services.tasks.models import resolve_model

        model_dir = resolve_model(spec.model, spec.cache_dir or None, seed=seed)
        engine = TorchEngine(TorchEngineConfig(model_dir=str(model_dir), dtype=spec.dtype, device=spec.device or None,
                                               max_batch_size=spec.max_batch_size,
                                               num_threads=spec.num_threads or None))
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


JUDGE_SYSTEM = "You are a careful, strict grader. You read a task, a response and a rubric, and rate the response."
JUDGE_USER = ("Task:\n{prompt}\n\nResponse:\n{response}\n\nRubric:\n{rubric}\n\n"
              "Rate the response from 0 to {scale:g} following the rubric. Answer with one line \"Score: N\", "
              "then one sentence saying why.")


def cache_key(rollout: Rollout, rubric: str, identity: str) -> str:
    """One verdict per (rollout, rubric, judge model)."""
    return hashlib.sha256("\x00".join((rollout.msg_id, rubric, identity)).encode()).hexdigest()


class LlmJudgeGrader:
    """A judge model rates the rollout against the rubric."""

    def __init__(self, spec: LlmJudgeSpec, backend: JudgeBackend, cache: JudgeCache) -> None:
        self.spec = spec
        self.name = spec.name or "llm_judge"
        self.backend = backend
        self.cache = cache

    def messages(self, rollout: Rollout) -> Messages:
        transcript = rollout.text()
        if len(transcript) > self.spec.max_response_chars:
            transcript = transcript[: self.spec.max_response_chars] + "\n[... cut]"
        return [{"role": "system", "content": JUDGE_SYSTEM},
                {"role": "user", "content": JUDGE_USER.format(prompt=rollout.prompt_text or "(not recorded)",
                                                              response=transcript, rubric=self.spec.rubric,
                                                              scale=self.spec.scale)}]

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        async def ask() -> tuple[GraderScore, bool]:
            try:
                output = await self.backend.complete(self.messages(rollout), self.spec.max_tokens, self.spec.prefill)
            except JudgeBackendError as e:
                return _failed(self, str(e)), False  # transient: asked again next time
            try:
                score, why = parse_judge_score(output, self.spec.scale)
            except JudgeParseError as e:
                return _failed(self, f"judge output unparseable: {e}"), True
            return GraderScore(grader=self.name, score=score, weight=self.spec.weight, explanation=why), True

        verdict = await self.cache.get_or_compute(cache_key(rollout, self.spec.rubric, self.backend.identity), ask)
        # a verdict cached by another grader with the same rubric and judge carries that grader's name and weight
        return msgspec.structs.replace(verdict, grader=self.name, weight=self.spec.weight)


# --- building graders from config ------------------------------------------------------------------------


class GraderFactory:
    """Builds each task's graders once, sharing judge backends (one engine per judge model) and the cache."""

    def __init__(self, sandboxes: SandboxClient | None, cache: JudgeCache, seed: int = 0) -> None:
        self.sandboxes = sandboxes
        self.cache = cache
        self.seed = seed
        self.backends: dict[str, JudgeBackend] = {}

    def backend(self, spec: TorchJudgeModel | OpenAIJudgeModel) -> JudgeBackend:
        key = repr(spec)
        if key not in self.backends:
            self.backends[key] = (OpenAIJudgeBackend(spec) if isinstance(spec, OpenAIJudgeModel)
                                  else EngineJudgeBackend.from_spec(spec, seed=self.seed))
        return self.backends[key]

    def build(self, task_name: str, specs: Sequence[GraderSpec]) -> list[Grader]:
        graders: list[Grader] = []
        for spec in specs or [RewardGraderSpec()]:
            if isinstance(spec, RewardGraderSpec):
                graders.append(RewardGrader(spec, task_name))
            elif isinstance(spec, SandboxTestsSpec):
                if self.sandboxes is None:
                    raise ValueError("sandbox_tests graders need a sandbox client")
                graders.append(SandboxTestsGrader(spec, self.sandboxes))
            else:
                graders.append(LlmJudgeGrader(spec, self.backend(spec.judge), self.cache))
        return graders

    async def close(self) -> None:
        for b in self.backends.values():
            await b.close()
