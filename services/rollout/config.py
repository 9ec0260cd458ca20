"""The rollout service's configuration (section ``[services.rollout]``). No ML imports."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.runtime.config import ConfigError
from services.runtime.weights_config import StoreConfig, StoreTransportConfig, TransportConfig

Pos = Annotated[int, msgspec.Meta(ge=1)]


class TorchEngineSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="torch"):
    """The transformers engine with continuous batching (CPU or GPU)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: torch device; empty picks cuda when available
    device: str = ""
    #: most sequences decoded together
    max_batch_size: Pos = 128
    #: torch intra-op threads (0: torch's default)
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: apply new weights between decode steps (in_flight) or only when no request runs
    weight_update_mode: Literal["in_flight", "between_requests"] = "in_flight"
    #: release the KV cache (on a GPU also the weights) while a colocated trainer ("trainer+rollout") steps
    enable_sleep_mode: bool = False


class VllmEngineSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="vllm"):
    """vLLM's async engine (``services/lib/engine/vllm_engine.py``): what GPU fleets generate with.

    Needs vLLM in the rollout's environment: ``pip install "rlbus[rollout,vllm]"`` on a CUDA machine, or
    ``./rlbus setup vllm`` here (the CPU build in ``.venv-vllm``, which the launcher then runs the rollout in).
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: most sequences in one engine step (further requests queue inside vLLM)
    max_num_seqs: Pos = 256
    #: longest prompt + completion in tokens (0: the model's own)
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: share of GPU memory vLLM may take (weights, activations, KV cache); GPU only
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    #: KV cache size in GiB (0: from gpu_memory_utilization on GPUs, 1 GiB on CPU)
    kv_cache_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: reuse KV blocks of shared prompt prefixes (a GRPO group shares its prompt); reset on every weight update
    enable_prefix_caching: bool = True
    #: GPUs one model is sharded over
    tensor_parallel_size: Pos = 1
    #: no torch.compile / CUDA graphs (faster start, slower steps)
    enforce_eager: bool = False
    #: apply new weights between engine steps (in_flight) or only when no request runs
    weight_update_mode: Literal["in_flight", "between_requests"] = "in_flight"
    #: release KV cache and weights while a colocated trainer ("trainer+rollout") steps; GPU only (vLLM on
    #: CPU has no sleep mode: start-up stops with an error saying so)
    enable_sleep_mode: bool = False
    #: further vLLM engine arguments, passed through as given (e.g. { block_size = 16 })
    engine_args: dict[str, int | float | str | bool] = {}


class AutoEngineSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="auto"):
    """The default: the faster engine for the model, by measurement (BENCHMARKS.md, "vLLM beside the torch
    engine"): vLLM with its defaults for models of at least ``vllm_min_params_m`` million parameters when
    the rollout's environment has vLLM (the launcher runs it in ``.venv-vllm`` when that exists), else the
    torch engine with its defaults. Name ``type = "torch"`` or ``"vllm"`` to choose and tune one."""

    #: smallest model (millions of parameters) served by vLLM; below it the torch engine is faster here
    vllm_min_params_m: Annotated[float, msgspec.Meta(ge=0.0)] = 50.0

    def picks_vllm(self, model: str) -> bool:
        """Whether ``model`` (a spec or directory) is served with vLLM where vLLM is installed: it has at
        least ``vllm_min_params_m`` million parameters (counted from its config, nothing loaded)."""
        from services.tasks.models import model_params

        params = model_params(model)
        return params is not None and params >= self.vllm_min_params_m * 1e6


EngineSection = TorchEngineSection | VllmEngineSection | AutoEngineSection


class SandboxSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sandbox each agent loop creates (see ``proto.sandbox.CreateRequest``); None = the service default."""

    #: ``"host"`` or an image name configured in the sandbox service
    base: str = "host"
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] | None = None
    pids: Annotated[int, msgspec.Meta(ge=4)] | None = None
    cpus: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    #: MiB of files it may write (work directory, /tmp, snapshots; counted in memory_mb too)
    disk_mb: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: files, directories and links it may create
    inodes: Annotated[int, msgspec.Meta(ge=64)] | None = None
    #: ``host:port`` entries the sandbox may reach (empty: no network)
    egress: list[str] = []


class AgentSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Budgets of the multi-turn agent loop (tasks with tools; see services/rollout/agent.py)."""

    #: most assistant turns; a rollout still calling tools after the last one ends with ``turn_limit``
    max_turns: Pos = 4
    #: most completion tokens (assistant + tool) per rollout; the next turn's generation is capped by what is left
    max_total_tokens: Pos = 1024
    #: wall-clock limit of one rollout in seconds (inference, tools, sandbox calls); past it: ``wall_time``
    wall_time_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    #: wall-time limit of one tool call inside the sandbox (a timed-out call is an observation, not an error)
    exec_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    #: seconds to wait for the sandbox service's reply to anything but an exec (create, pause, resume, ...)
    sandbox_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    #: characters of stdout and of stderr kept in an observation (the rest is cut, and the cut is said)
    max_observation_chars: Pos = 2000
    #: chat role of observation messages (``user`` fits every chat template; ``tool`` where the template has it)
    observation_role: str = "user"
    #: hand the finished sandbox (paused, lease extended) to the judge, which destroys it after grading;
    #: false: the rollout destroys it itself
    handoff: bool = True
    #: lease the judge gets on a handed-off sandbox (seconds); an unclaimed sandbox goes when it expires
    handoff_lease_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    #: times an episode starts again from its beginning, on a new sandbox, when the sandbox instance that
    #: owned its sandbox stops or crashes (the rollout counts as retried: ``rollout/agent_sandbox_retries``
    #: and the rollout's ``metadata["sandbox_retries"]``); each attempt has its own ``wall_time_s``. Past
    #: them the rollout ends with ``finish_reason = "error"`` and the reason, as any sandbox failure does
    sandbox_retries: Annotated[int, msgspec.Meta(ge=0)] = 2
    sandbox: SandboxSection = msgspec.field(default_factory=SandboxSection)


class WeightsSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A weightsync relay a rollout reads versions from (``[services.rollout] weights_from``)."""

    #: the relay's scope (``[services.weightsync] relay.scope``)
    scope: str
    #: the relay's store (absent: the [weights] store)
    store: StoreConfig | None = None


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: the inference engine, chosen by `type`: "auto" (default: vLLM for models >= 50 M parameters where
    #: vLLM is installed, else torch), "torch" or "vllm"
    engine: EngineSection = msgspec.field(default_factory=AutoEngineSection)
    #: prompt tickets worked on at once (each runs group_size agent loops concurrently)
    max_tickets: Pos = 64
    #: seconds between metrics reports (pending requests, tokens/s)
    report_every_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    #: seconds to wait for the trainer's first weight version before serving anyway
    initial_weights_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0
    #: seconds a ticket waits for the engine to reach the ticket's admission version
    version_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: read weight versions through a weightsync relay instead of straight from the trainer's store:
    #: { scope = "<the relay's scope>", store = {...} (the relay's store; absent: [weights] store) }. Needs
    #: the store transport ([weights] type = "store"); absent: versions come as [weights] says
    weights_from: WeightsSource | None = None
    #: budgets of agent loops (tasks with tools); single-turn tasks ignore it
    agent: AgentSection = msgspec.field(default_factory=AgentSection)

    def weight_source(self, weights: TransportConfig) -> TransportConfig:
        """The transport this rollout reads versions with: ``weights`` (the run's ``[weights]``), or its scope
        and store replaced by ``weights_from`` (a relay's)."""
        if self.weights_from is None:
            return weights
        if not isinstance(weights, StoreTransportConfig):
            raise ConfigError(f"config key services.rollout.weights_from: a relay serves the store transport only, "
                              f"but [weights] type is {weights.type!r}")
        return msgspec.structs.replace(weights, scope=self.weights_from.scope,
                                       store=self.weights_from.store or weights.store)
