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
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Weight = Annotated[float, msgspec.Meta(ge=0.0)]
OnError = Literal["zero", "skip"]


class _GraderBase(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: share of this grader in the weighted mean
    weight: Weight = 1.0
    #: name shown in the trajectory's scores (default: the type, prefixed with the task for rewards)
    name: str = ""
    #: a grader that fails (sandbox gone, judge output unreadable) counts as 0 ("zero") or is left out of
    #: the mean ("skip"); either way its error is recorded in the trajectory
    on_error: OnError = "zero"


class RewardGraderSpec(_GraderBase, tag_field="type", tag="reward"):
    """The task's own reward function on the assistant's text."""


class SandboxTestsSpec(_GraderBase, tag_field="type", tag="sandbox_tests"):
    """Fork the rollout's sandbox, run the task's hidden tests in the fork, score the share that passed.

    The rollout's own sandbox is not touched; the fork is destroyed after the run.
    """

    #: lease of the fork (seconds): the safety net should the judge die mid-test
    fork_lease_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: wall-time limit of the test run; 0 takes the task's own
    timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class TorchJudgeModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="torch"):
    """A judge model run in the judge process by the torch engine (greedy decoding)."""

    #: builtin model (smollm2, tiny-addition) or a Hugging Face directory
    model: str = "smollm2"
    #: where builtin models are cached (default ~/.cache/rlbus or $RLBUS_CACHE)
    cache_dir: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: torch device; empty picks cuda when available
    device: str = ""
    #: torch intra-op threads (0: torch's default)
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 32


class OpenAIJudgeModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="openai"):
    """Any OpenAI-compatible chat-completions endpoint (vLLM's server, a hosted API)."""

    #: e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended)
    base_url: str
    model: str
    #: environment variable holding the API key (none is sent when it is unset)
    api_key_env: str = "OPENAI_API_KEY"
    #: seconds to wait for one completion
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


JudgeModel = TorchJudgeModel | OpenAIJudgeModel


class LlmJudgeSpec(_GraderBase, tag_field="type", tag="llm_judge"):
    """A judge model rates the transcript against a rubric; results are cached per (rollout, rubric, judge)."""

    rubric: str
    judge: JudgeModel = msgspec.field(default_factory=TorchJudgeModel)
    #: the judge answers on 0..scale ("Score: N"); the grader's score is N / scale
    scale: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    #: the judge's answer is started with this (engine judges; endpoints cannot), so small models write the
    #: number next; empty: none
    prefill: str = "Score:"
    #: tokens the judge may write
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 64
    #: characters of the rollout's transcript shown to the judge (the end is cut)
    max_response_chars: Annotated[int, msgspec.Meta(ge=1)] = 4000


GraderSpec = RewardGraderSpec | SandboxTestsSpec | LlmJudgeSpec


class JudgeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: rollouts graded at once by one judge process
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
    #: options per task name, passed to the task factory (must match the trainer's)
    task_options: dict[str, dict[str, int | float | str | bool]] = {}
    #: graders per task name (see the module docstring); a task without an entry uses its reward function
    graders: dict[str, list[GraderSpec]] = {}
    #: destroy a rollout's sandbox once its trajectory is published (the rollout hands it over paused)
    destroy_sandboxes: bool = True
    #: seconds to wait for the sandbox service's reply to anything but an exec
    sandbox_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    #: LLM-judge results kept in the per-process cache (least recently used go first)
    judge_cache_entries: Annotated[int, msgspec.Meta(ge=0)] = 10_000
