"""Graders: composable, weighted scorers of finished rollouts (configured per task, see ``config.py``).

* :class:`RewardGrader` — the task's reward function on the assistant's text;
* :class:`SandboxTestsGrader` — forks the rollout's sandbox, runs the task's hidden tests in the fork and
  scores the share that passed; the rollout's own sandbox is never touched and the fork is destroyed;
* :class:`LlmJudgeGrader` — a judge model rates the transcript against a rubric; malformed judge output is a
  recorded parse failure, not a crash; results are cached per (rollout, rubric, judge). The judge models
  themselves (backends, output parsing, the cache) are in :mod:`services.tasks.judge_backends`, and
  :meth:`GraderFactory.backend` picks one per judge spec.

Every grader returns a :class:`proto.trajectories.GraderScore` (score in [0, 1], weight, explanation, error)
and never raises for a failure of what it grades with; :func:`grade_all` runs them concurrently and combines
them into the reward (weighted mean).

**User code is bounded.** A task's own methods (``reward``, ``hidden_tests``) are user code: graders call
them through a :class:`UserCode` runner, never directly. The judge service's runner
(``services/judge/user_code.py``) runs them in worker processes with a per-call timeout and kills a worker
whose call does not return. When the task's code raises, hangs, kills its worker, or its reward is not a
finite number in [0, 1], the grader raises :class:`UserCodeError` and :func:`grade_all` reports the sample as
**failed** (``Grading.failure``, with the grader's name and the reason) instead of scoring it: a
broken reward says nothing about the policy. A grader configured ``on_error = "skip"`` is left out instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from proto import sandbox as api
from proto.rollouts import Rollout
from proto.trajectories import GraderScore
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.runtime import tracing
from services.tasks.base import Prompt, Reward
from services.tasks.grader_specs import (
    GraderSpec,
    JudgeModel,
    LlmJudgeSpec,
    OpenAIJudgeModel,
    RewardGraderSpec,
    SandboxTestsSpec,
    TorchJudgeModel,
    VllmJudgeModel,
)
from services.tasks.judge_backends import (
    EngineJudgeBackend,
    JudgeBackend,
    JudgeBackendError,
    JudgeCache,
    JudgeParseError,
    Messages,
    OpenAIJudgeBackend,
    parse_judge_score,
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
    """The policy's own words: assistant turns joined by newlines (a single-turn rollout's completion), every
    segment's in order for an episode of several."""
    return "\n".join(t.text for t in rollout.all_turns() if t.role == "assistant")


class Grader(Protocol):
    """Scores one rollout; failures of what it grades with are returned as a GraderScore with ``error`` set,
    not raised; a failure of the task's own code raises :class:`UserCodeError` (the sample fails)."""

    name: str
    spec: GraderSpec

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        ...


def _failed(grader: Grader, error: str, explanation: str = "") -> GraderScore:
    return GraderScore(grader=grader.name, score=0.0, weight=grader.spec.weight, error=error, explanation=explanation)


# --- user code, bounded ----------------------------------------------------------------------------------

#: how a task's code failed: raised, did not return in time, its worker died, or returned something unusable
UserCodeFailure = Literal["exception", "timeout", "crash", "bad_value", "out_of_range"]


class UserCodeError(Exception):
    """The task's own code failed on this rollout; the sample cannot be scored (see the module docstring)."""

    def __init__(self, kind: UserCodeFailure, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UserCode(Protocol):
    """Runs a task's methods (user code) on behalf of the graders."""

    async def call(self, task_name: str, task: Any, method: str, *args: Any, scope: str | None = None) -> Any:
        """``task.<method>(*args)``; raises :class:`UserCodeError` when it raises, does not return within the
        runner's bound, or its process dies. ``scope`` names the prompt group the call is for: a runner
        may fail a group's remaining calls at once after one of them hung (see the judge's runner)."""
        ...


class DirectUserCode:
    """Calls the task in the caller's thread, unbounded: for tools and tests that build graders by hand.

    The judge service never uses it: a hang here would stop the event loop (and its heartbeats).
    """

    async def call(self, task_name: str, task: Any, method: str, *args: Any, scope: str | None = None) -> Any:
        try:
            return getattr(task, method)(*args)
        except Exception as e:  # user code: reported as the sample's failure, with its type
            raise UserCodeError("exception", f"{method}() raised {type(e).__name__}: {e}") from e


def group_scope(rollout: Rollout) -> str:
    """The prompt group a rollout belongs to, as the ``scope`` of its user-code calls."""
    return f"{rollout.run_id}/{rollout.group_id}/{rollout.prompt_id}"


def check_reward(r: Any, method: str = "reward") -> Reward:
    """``r`` as a Reward whose value is a finite number in [0, 1] (the task contract), else UserCodeError."""
    value = getattr(r, "value", r)
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserCodeError("bad_value", f"{method}() returned {r!r}, not a Reward with a numeric value") from None
    if not math.isfinite(v):
        raise UserCodeError("bad_value", f"{method}() returned {v} (not a finite number)")
    if not 0.0 <= v <= 1.0:
        raise UserCodeError("out_of_range", f"{method}() returned {v:g}, outside the task's range [0, 1]")
    explanation = r.explanation if isinstance(r, Reward) else ""
    return Reward(v, explanation)


@dataclass(frozen=True)
class Grading:
    """What :func:`grade_all` found: the reward, every grader's score, and why the sample failed (if it did)."""

    reward: float
    scores: list[GraderScore]
    #: ``"<grader>: <reason>"`` when a grader's user code failed (the sample is not trainable), else None
    failure: str | None = None
    failure_kind: UserCodeFailure | None = None


async def _grade_one(g: Grader, rollout: Rollout, task: Any) -> tuple[GraderScore, UserCodeError | None]:
    with tracing.span(f"grade {g.name}"):
        try:
            return await g.grade(rollout, task), None
        except UserCodeError as e:
            return _failed(g, str(e), "the task's code failed: the sample is scored as failed"), e


async def grade_all(graders: Sequence[Grader], rollout: Rollout, task: Any) -> Grading:
    """Every grader's score (concurrently) and their weighted mean; failed graders count per ``on_error``,
    and a failure of the task's own code fails the sample (unless that grader is ``on_error = "skip"``)."""
    results = list(await asyncio.gather(*(_grade_one(g, rollout, task) for g in graders)))
    scores = [s for s, _ in results]
    total = weight = 0.0
    for g, (s, user_error) in zip(graders, results, strict=True):
        if s.error is not None and g.spec.on_error == "skip":
            continue
        if user_error is not None:
            return Grading(0.0, scores, f"{g.name}: {user_error}", user_error.kind)
        total += s.weight * s.score
        weight += s.weight
    return Grading(total / weight if weight > 0 else 0.0, scores)


# --- reward functions ------------------------------------------------------------------------------------


class RewardGrader:
    """The task's reward function (what single-turn tasks always used)."""

    def __init__(self, spec: RewardGraderSpec, task_name: str, user_code: UserCode | None = None) -> None:
        self.spec = spec
        self.name = spec.name or f"{task_name}.reward"
        self.user_code: UserCode = user_code or DirectUserCode()

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        r = check_reward(await self.user_code.call(rollout.task, task, "reward", prompt_of(rollout),
                                                   assistant_text(rollout), scope=group_scope(rollout)))
        return GraderScore(grader=self.name, score=r.value, weight=self.spec.weight, explanation=r.explanation)


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

    def __init__(self, spec: SandboxTestsSpec, sandboxes: SandboxClient, user_code: UserCode | None = None) -> None:
        self.spec = spec
        self.name = spec.name or "sandbox_tests"
        self.sandboxes = sandboxes
        self.user_code: UserCode = user_code or DirectUserCode()

    async def grade(self, rollout: Rollout, task: Any) -> GraderScore:
        if rollout.sandbox_id is None:
            return _failed(self, "the rollout has no sandbox to test (a single-turn task, or it failed before one "
                                 "was created)")
        if not isinstance(task, TestedTask):
            return _failed(self, f"task {rollout.task!r} has no hidden_tests(prompt); configure another grader")
        tests = await self.user_code.call(rollout.task, task, "hidden_tests", prompt_of(rollout),
                                          scope=group_scope(rollout))
        if not isinstance(tests, HiddenTests):
            raise UserCodeError("bad_value", f"hidden_tests() returned {type(tests).__name__}, not HiddenTests")
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

    def __init__(self, sandboxes: SandboxClient | None, cache: JudgeCache, seed: int = 0,
                 user_code: UserCode | None = None) -> None:
        self.sandboxes = sandboxes
        self.cache = cache
        self.seed = seed
        #: runs the tasks' own code (the judge passes its bounded process pool; default: direct, unbounded)
        self.user_code: UserCode = user_code or DirectUserCode()
        self.backends: dict[str, JudgeBackend] = {}

    def backend(self, spec: JudgeModel) -> JudgeBackend:
        """The backend for a judge spec, by the spec's type (the one place that chooses); one per distinct spec."""
        key = repr(spec)
        if key not in self.backends:
            if isinstance(spec, OpenAIJudgeModel):
                self.backends[key] = OpenAIJudgeBackend(spec)
            elif isinstance(spec, TorchJudgeModel | VllmJudgeModel):
                self.backends[key] = EngineJudgeBackend.from_spec(spec, seed=self.seed)
            else:
                raise TypeError(f"no judge backend for {type(spec).__name__}")
        return self.backends[key]

    def build(self, task_name: str, specs: Sequence[GraderSpec]) -> list[Grader]:
        graders: list[Grader] = []
        for spec in specs or [RewardGraderSpec()]:
            if isinstance(spec, RewardGraderSpec):
                graders.append(RewardGrader(spec, task_name, self.user_code))
            elif isinstance(spec, SandboxTestsSpec):
                if self.sandboxes is None:
                    raise ValueError("sandbox_tests graders need a sandbox client")
                graders.append(SandboxTestsGrader(spec, self.sandboxes, self.user_code))
            else:
                graders.append(LlmJudgeGrader(spec, self.backend(spec.judge), self.cache))
        return graders

    async def close(self) -> None:
        for b in self.backends.values():
            await b.close()
