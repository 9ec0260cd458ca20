"""Grader configurations, chosen by ``type`` (msgspec only: no ML imports).

A judge configures graders per task; the reward is the weighted mean of their scores (each in [0, 1]).
See ``services/judge/config.py`` for the TOML form.
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


class VllmJudgeModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="vllm"):
    """A judge model run in the judge process by vLLM's engine (greedy decoding); needs vLLM in the judge's
    environment (the launcher runs such a judge under ``.venv-vllm`` on CPU machines)."""

    #: builtin model (smollm2, tiny-addition) or a Hugging Face directory
    model: str = "smollm2"
    #: where builtin models are cached (default ~/.cache/rlbus or $RLBUS_CACHE)
    cache_dir: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: most sequences in one engine step
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64
    #: longest prompt + answer in tokens (0: the model's own)
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: share of GPU memory this judge may take; GPU only
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    #: KV cache size in GiB (0: from gpu_memory_utilization on GPUs, 1 GiB on CPU)
    kv_cache_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


JudgeModel = TorchJudgeModel | OpenAIJudgeModel | VllmJudgeModel


class LlmJudgeSpec(_GraderBase, tag_field="type", tag="llm_judge"):
    """A judge model rates the transcript against a rubric; results are cached per (rollout, rubric, judge)."""

    #: what the judge model is asked to rate the transcript on (its answer is read as a score in [0, 1])
    rubric: str
    #: the judge model, chosen by ``type``: torch (in the judge process), vllm, or openai (any
    #: OpenAI-compatible server)
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
