"""verifiers environments, unchanged, as a black-box agent task: their tasks are the prompts, their agent
loop runs against the episode's session on the rollout's endpoint, their reward functions are the reward.

Run-file form::

    [task]
    name = "verifiers"

    [task.options]
    env = "my_env"                  # a module (see below) or "pkg.module:function"
    env_args = { difficulty = 2 }   # keyword arguments of load_environment (or of the taskset's config)
    eval_size = 20                  # tasks held out for evaluation

Needs ``verifiers`` (0.4.0, the ``agents`` extra). verifiers 0.4.0's stack is ``verifiers.v1``: an
environment (``vf.Env``) is a taskset (``vf.Taskset`` yielding ``vf.Task`` s, whose ``@vf.reward`` methods
score a finished trace) played by agents (a harness program talking to the model through verifiers'
interception server). ``env`` names one of:

* ``"pkg.module:function"``: ``function(**env_args)`` returns the ``vf.Env``;
* ``"pkg.module"`` with a ``load_environment``: ``load_environment(**env_args)`` returns the ``vf.Env``;
* ``"pkg.module"`` exporting a ``vf.Taskset`` subclass in ``__all__`` (a verifiers taskset package): the
  environment is verifiers' own ``vf.load_environment`` for it, ``env_args`` being the taskset's config.

A module that does not import, has none of these, or gives something that is not a ``vf.Env`` is refused
naming ``task.options.env`` when the environment is first needed: the trainer's first prompts at start-up,
the rollout's first episode (the judge never loads it, nor imports verifiers: the reward reads the verdict). Agent seats that do not pin a harness run rlbus's in-process chat
harness (:mod:`services.tasks.verifiers_harness`; verifiers' own chat harnesses install themselves with
``uv`` over the network) in verifiers' ``subprocess`` runtime.

**Prompts.** The taskset's tasks in ``load()`` order: the first ``eval_size`` are the eval split (verifiers
tasksets carry no separate eval split), the rest the training stream, each epoch in an order drawn from
``(seed, epoch)`` (an infinite taskset: in order). A prompt carries the task's position (``task_idx``).

**Episodes.** ``solve`` runs verifiers' ``Env.run_episode`` for that task with a model client pointed at the
session (the session id in the URL path, ``/s/<session>/v1``), so every model call of the episode is
recorded by the session and becomes the trajectory; verifiers scores the trace with the task's reward
functions inside the episode (bounded by the rollout's ``agent.wall_time_s``, as every agent is), and
``solve`` returns their verdict (``{"rewards": {name: [score, weight]}, "errors": [...]}``, kept as the
sample's ``agent_answer``). An episode that failed elsewhere (the environment's ``run``, the harness, a model
call) raises instead: the rollout ends it with ``error`` and the reason, and it is not trained.

**Reward.** The judge reads the verdict: the weighted mean of the reward functions' scores (weights as
verifiers declares them; a weight of 0 is a metric-like signal and does not count), each function's score
in the explanation. A reward function that raised, returned something that is not a finite number in
[0, 1] (rlbus's reward range), or did not run gives reward 0 with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import itertools
import json
import math
import random
import sys
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from services.runtime.config import ConfigError
from services.tasks.base import Prompt, Reward, register_task
from services.tasks.black_box import AgentEndpoint, BlackBoxAgentTask

#: characters of an error kept in the verdict (the verdict travels in the sample's metadata)
ERROR_CHARS = 300
#: errors kept in the verdict (with the rewards, it must fit the 2,000 characters kept of ``solve``'s answer)
MAX_ERRORS = 3
#: the error type verifiers records for a failure in a task's reward functions (its scoring boundary)
SCORING_ERROR = "TaskError"
#: prefix of the names under which dotted taskset modules are registered for verifiers' loader
ALIAS_PREFIX = "rlbus_vf_"


class VerifiersEnvError(ConfigError):
    """A verifiers environment could not be loaded (the message names the option)."""


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as e:  # the user's module, any error: the option is what to change
        raise VerifiersEnvError(f"task.options.env: module {module!r} does not import: "
                                f"{type(e).__name__}: {e}") from e


def load_env(spec: str, env_args: dict[str, Any]) -> Any:
    """The ``vf.Env`` that ``spec`` names with ``env_args`` (see the module docstring)."""
    import verifiers.v1 as vf  # not at import: the judge builds this task to read verdicts, never loading verifiers

    if not spec:
        raise VerifiersEnvError("task.options.env: name the environment: a module or pkg.module:function")
    module_name, _, attr = spec.partition(":")
    module = _import(module_name)
    factory = getattr(module, attr or "load_environment", None)
    if attr and not callable(factory):
        raise VerifiersEnvError(f"task.options.env: {module_name!r} has no function {attr!r}")
    if factory is None:
        exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
        if not any(isinstance(c, type) and issubclass(c, vf.Taskset) for c in exported):
            raise VerifiersEnvError(f"task.options.env: module {module_name!r} has no load_environment and "
                                    "exports no verifiers Taskset in __all__")
        return _taskset_env(module_name, module, env_args)
    try:
        env = factory(**env_args)
    except Exception as e:  # the user's factory: name the option and the error
        raise VerifiersEnvError(f"task.options.env: {spec}(**task.options.env_args) raised "
                                f"{type(e).__name__}: {e}") from e
    if not isinstance(env, vf.Env):
        raise VerifiersEnvError(f"task.options.env: {spec} returned a {type(env).__name__}, "
                                "not a verifiers environment (verifiers.v1.Env)")
    return _with_rlbus_harness(env)


def _taskset_env(module_name: str, module: Any, env_args: dict[str, Any]) -> Any:
    import verifiers.v1 as vf

    taskset_id = module_name
    if "." in module_name:  # verifiers imports tasksets by an undotted id
        taskset_id = ALIAS_PREFIX + module_name.replace(".", "__")
        sys.modules.setdefault(taskset_id, module)
    try:
        cfg = vf.resolve_env_config({"taskset": {**env_args, "id": taskset_id}})
    except Exception as e:  # pydantic's validation error names the field
        raise VerifiersEnvError(f"task.options.env_args: not the config of taskset {module_name!r}: {e}") from e
    return _with_rlbus_harness(vf.load_environment(cfg))


def _with_rlbus_harness(env: Any) -> Any:
    """``env`` rebuilt with rlbus's harness (and verifiers' local runtime) on every seat that pins no harness."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    from services.tasks.verifiers_harness import harness_id

    seats = {name: spec for name, spec in agent_config_fields(env.config).items() if spec.harness is None}
    if not seats:
        return env
    update = {name: spec.model_copy(update={"harness": vf.HarnessConfig(id=harness_id()),
                                            "runtime": vf.SubprocessConfig()})
              for name, spec in seats.items()}
    return type(env)(env.config.model_copy(update=update))


class VerifiersEpisodeError(RuntimeError):
    """The environment's episode failed before it could be scored (its run, its harness, a model call)."""


def verdict(episode: Any) -> dict[str, Any]:
    """What the episode's reward functions said: every trace's rewards and the scoring errors, JSON-ready.

    Raises:
        VerifiersEpisodeError: the episode failed other than in its reward functions (the rollout ends the
            episode with ``error`` and this reason; it is not trained).
    """
    failed = [f"{e.type}: {e.message}"[:ERROR_CHARS] for e in episode.errors]
    failed += [f"{e.type}: {e.message}"[:ERROR_CHARS] for t in episode.traces for e in t.errors
               if e.type != SCORING_ERROR]
    if failed:
        raise VerifiersEpisodeError("the verifiers episode failed: " + "; ".join(failed[:MAX_ERRORS]))
    rewards: dict[str, list[float | None]] = {}
    errors: list[str] = []
    for trace in episode.traces:
        errors += [f"{e.type}: {e.message}"[:ERROR_CHARS] for e in trace.errors]
        for name, r in trace.rewards.items():
            rewards[name] = [None, 1.0] if r is None else [r.score, r.weight]
    return {"rewards": rewards, "errors": errors[:MAX_ERRORS]}


def reward_of(v: dict[str, Any]) -> Reward:
    """The weighted mean of a verdict's scores, each in the explanation; 0 with the reason when one failed."""
    if v.get("errors"):
        return Reward(0.0, "the reward functions failed: " + "; ".join(v["errors"]))
    parts, total, weights = [], 0.0, 0.0
    for name, (score, weight) in sorted(v.get("rewards", {}).items()):
        if score is None:
            return Reward(0.0, f"reward function {name} did not run")
        if not isinstance(score, (int, float)) or not math.isfinite(score) or not 0.0 <= score <= 1.0:
            return Reward(0.0, f"reward function {name} returned {score!r}, not a number in [0, 1]")
        parts.append(f"{name}={score:g} (weight {weight:g})")
        if weight > 0:
            total, weights = total + weight * score, weights + weight
    if not parts:
        return Reward(0.0, "the environment has no reward function")
    mean = total / weights if weights else 0.0
    return Reward(mean, f"{', '.join(parts)}: weighted mean {mean:g}")


@register_task("verifiers")
class VerifiersTask(BlackBoxAgentTask):
    """A verifiers environment (see the module docstring).

    Args:
        env: the environment: a module (``load_environment`` or a verifiers taskset) or ``pkg.module:function``.
        env_args: keyword arguments of ``load_environment`` (a taskset: its config fields).
        eval_size: the first tasks, held out for evaluation.
        max_new_tokens: the completion budget of one model call.
    """

    name = "verifiers"
    stop: list[str] = []

    def __init__(self, env: str = "", env_args: dict[str, Any] | None = None, eval_size: int = 20,
                 max_new_tokens: int = 256, **unknown: Any) -> None:
        if unknown:
            known = [k for k in inspect.signature(VerifiersTask).parameters if k != "unknown"]
            raise VerifiersEnvError(f"task.options.{sorted(unknown)[0]}: unknown option of the verifiers task; "
                                    f"known: {', '.join(known)}")
        for key, value in (("eval_size", eval_size), ("max_new_tokens", max_new_tokens)):
            if value < 1:
                raise VerifiersEnvError(f"task.options.{key}: must be at least 1, got {value}")
        self.spec, self.eval_size, self.max_new_tokens = env, eval_size, max_new_tokens
        self.env_args = dict(env_args or {})
        self._tasks: list[Any] = []  # the taskset's tasks read so far, in load() order
        self._serving: contextlib.AsyncExitStack | None = None
        self._serving_lock: asyncio.Lock | None = None

    @cached_property
    def env(self) -> Any:
        """The environment, loaded on first use: by the trainer's first prompts and the rollout's first
        episode (a broken one stops them there, naming the option); never by the judge, whose ``reward``
        reads only the verdict (its workers' first call would otherwise pay for loading the environment)."""
        env = load_env(self.spec, self.env_args)
        self._source = iter(env.taskset)
        self._bounded = env.taskset.bounded
        if self._bounded:
            self._tasks += self._source
            if len(self._tasks) <= self.eval_size:
                raise VerifiersEnvError(f"task.options.eval_size: the taskset has {len(self._tasks)} tasks; "
                                        f"holding out {self.eval_size} leaves none to train on")
        return env

    def _read(self, upto: int | None) -> list[Any]:
        """The tasks up to position ``upto`` (all of them: None; a bounded taskset only)."""
        self.env  # noqa: B018  (loads the environment and its first tasks)
        need = None if upto is None else upto + 1 - len(self._tasks)
        if need is None or need > 0:
            self._tasks += itertools.islice(self._source, need)
        return self._tasks

    def _prompt(self, pid: str, idx: int) -> Prompt:
        tasks = self._read(idx)
        if idx >= len(tasks):
            raise VerifiersEnvError(f"the taskset has no task {idx} (it has {len(tasks)})")
        data = tasks[idx].data
        return Prompt(id=pid, text=data.prompt_text, metadata={"task_idx": str(idx)})

    @cached_property
    def _eval(self) -> list[Prompt]:
        return [self._prompt(f"verifiers/eval/{k}", k) for k in range(self.eval_size)]

    def eval_prompts(self) -> list[Prompt]:
        """The first ``eval_size`` tasks; prompt id ``verifiers/eval/<k>``."""
        return list(self._eval)

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """The other tasks, an epoch at a time in an order drawn from ``(seed, epoch)``; prompt id
        ``verifiers/train/<seed>/<position>``."""
        self.env  # noqa: B018  (loads the environment: is the taskset bounded?)
        if not self._bounded:
            for position in itertools.count(start):
                yield self._prompt(f"verifiers/train/{seed}/{position}", self.eval_size + position)
        train = list(range(self.eval_size, len(self._read(None))))
        for epoch in itertools.count(start // len(train)):
            order = list(train)
            random.Random(f"verifiers:{seed}:{epoch}").shuffle(order)
            for k in range(max(0, start - epoch * len(train)), len(train)):
                yield self._prompt(f"verifiers/train/{seed}/{epoch * len(train) + k}", order[k])

    async def _serve(self) -> None:
        """Enter the environment's ``serving()`` once (its interception server, shared by every episode)."""
        if self._serving_lock is None:
            self._serving_lock = asyncio.Lock()
        async with self._serving_lock:
            if self._serving is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._serving = stack

    async def aclose(self) -> None:
        """Leave ``serving()`` (stops the interception server)."""
        if self._serving is not None:
            stack, self._serving = self._serving, None
            await stack.aclose()

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> str:
        """One verifiers episode of the prompt's task against the session; returns the rubric's verdict (JSON)."""
        import verifiers.v1 as vf

        await self._serve()
        task = self._read(int(prompt.metadata["task_idx"]))[int(prompt.metadata["task_idx"])]
        base = f"{endpoint.base_url.removesuffix('/v1')}/s/{endpoint.api_key}/v1"
        ctx = vf.ModelContext(model=endpoint.model, client=vf.EvalClientConfig(base_url=base),
                              sampling=vf.SamplingConfig(max_tokens=self.max_new_tokens))
        episode = await self.env.run_episode(task, ctx)
        return json.dumps(verdict(episode))

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """The verdict ``solve`` returned (the sample's ``agent_answer``) as a reward (see the module docstring)."""
        raw = prompt.metadata.get("agent_answer")
        if raw is None:
            return Reward(0.0, "no verdict of the environment's reward functions (the episode did not finish)")
        try:
            v = json.loads(raw)
        except ValueError:
            return Reward(0.0, f"the verdict is not JSON: {raw[:200]!r}")
        return reward_of(v)
