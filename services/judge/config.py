"""The judge service's configuration (section ``[services.judge]``). msgspec only: no ML imports.

Graders are configured per task, each chosen by its ``type`` and weighted; the reward is the weighted
mean of their scores (each in [0, 1])::

    [[services.judge.graders.coding]]
    type = "sandbox_tests"          # hidden tests in a fork of the rollout's sandbox
    weight = 1.0

    [[services.judge.graders.coding]]
    type = "llm_judge"              # a judge model with a rubric
    weight = 0.25
    rubric = "Is the code clear and correct?"
    judge = { type = "torch", model = "smollm2" }      # or { type = "openai", base_url = "...", model = "..." }

A task without an entry is graded by its reward function alone (``[{ type = "reward" }]``).

The tasks' own code (reward functions, hidden-test builders) runs in worker processes, each call bounded::

    [services.judge.user_code]
    workers = 2                     # kept running; more are started while all are busy, up to max_workers
    timeout_s = 10.0                # then the worker is killed and the sample scored failed (and its
                                    # group's calls still to come fail at once)
    builtin_in_process = true       # rlbus's own bounded rewards (addition, word problems) run in the judge

"""

from __future__ import annotations

from typing import Annotated

import msgspec

from services.lib.user_code import resolve_max_workers
from services.tasks.grader_specs import GraderSpec


class UserCodeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Bounds on the tasks' own code (see ``services/judge/user_code.py``)."""

    #: worker processes running the tasks' reward functions and hidden-test builders
    workers: Annotated[int, msgspec.Meta(ge=1, le=256)] = 2
    #: seconds one call may run; then its worker is killed (and replaced) and the sample is scored failed
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    #: address-space limit of each worker in MiB (0: none); a reward needing more raises MemoryError (failed)
    memory_mb: Annotated[int, msgspec.Meta(ge=0)] = 4096
    #: seconds a new worker may take to start (Python, the task's imports); not charged to any call
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: the most worker processes: one is started in place of each stuck one (a call running longer than
    #: grow_after_s, such as a hang waiting out timeout_s) when a call finds none idle; 0: max(16, workers)
    max_workers: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    #: seconds a call runs before its worker counts as stuck (and the pool may grow past it)
    grow_after_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    #: seconds a worker beyond `workers` stays idle before it is closed
    idle_retire_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    #: call the reward of rlbus's own tasks that declare it bounded (``reward_in_process``: exact-match or
    #: last-number parsing of the completion) in the judge itself, not in a worker: ~0.2 ms a sample less,
    #: on a synchronous step's critical path. Tasks of other modules, and subclasses that override the
    #: reward, always run in workers. false: every call in a worker
    builtin_in_process: bool = True

    def __post_init__(self) -> None:
        resolve_max_workers(self, "services.judge.user_code")


class JudgeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: rollouts graded at once by one judge process
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
    #: graders per task name (see the module docstring); a task without an entry uses its reward function
    graders: dict[str, list[GraderSpec]] = {}
    #: destroy a rollout's sandbox once its trajectory is published (the rollout hands it over paused)
    destroy_sandboxes: bool = True
    #: seconds to wait for the sandbox service's reply to anything but an exec
    sandbox_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    #: LLM-judge results kept in the per-process cache (least recently used go first)
    judge_cache_entries: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    #: bounds on the tasks' own code (reward functions): worker processes, per-call timeout, memory
    user_code: UserCodeConfig = msgspec.field(default_factory=UserCodeConfig)
    #: a rollout delivered more often than this without being settled (it killed or hung a judge each time)
    #: is scored failed and dead-lettered instead of handed to the next judge (the consumer gives up at 5)
    poison_after_deliveries: Annotated[int, msgspec.Meta(ge=1, le=4)] = 3
