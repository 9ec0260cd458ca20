"""The rollout service's configuration (section ``[services.rollout]``). No ML imports."""

from __future__ import annotations

from typing import Annotated

import msgspec

from services.lib.engine.config import AutoEngineConfig, EngineConfig
from services.lib.user_code import resolve_max_workers
from services.runtime.config import ConfigError, tag_of
from services.runtime.weights_config import StoreConfig, StoreTransportConfig, TransportConfig

Pos = Annotated[int, msgspec.Meta(ge=1)]


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


class ToolWorkersSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Worker processes running sync function tools (see services/rollout/tool_runner.py)."""

    #: worker processes kept for sync function tools (started on first use); 0: every sync tool runs in a
    #: thread of the rollout process, abandoned (still running) past its timeout
    workers: Annotated[int, msgspec.Meta(ge=0, le=256)] = 2
    #: the most worker processes: one is started in place of each stuck one (a call running longer than
    #: grow_after_s) when a call finds none idle; 0: max(16, workers)
    max_workers: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    #: address-space limit of each worker in MiB (0: none); a tool needing more raises MemoryError (an error
    #: observation)
    memory_mb: Annotated[int, msgspec.Meta(ge=0)] = 4096
    #: seconds a new worker may take to start and to import a tool's module; not charged to any call
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: seconds a call runs before its worker counts as stuck (the pool may grow past it; it runs at niceness 19)
    grow_after_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    #: seconds a worker beyond `workers` stays idle before it is closed
    idle_retire_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0

    def __post_init__(self) -> None:
        resolve_max_workers(self, "services.rollout.agent.tool_workers")


class AgentSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Budgets and tools of multi-turn episodes (environments and sandbox agents; see services/rollout/episode.py)."""

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
    #: how assistant turns of function-tool environments are read for tool calls: ``hermes`` (Qwen, Hermes),
    #: ``llama3_json``, ``mistral`` or ``markdown`` (see services/tasks/toolcalls.py); it should match the
    #: model's chat template, which renders the tools
    tool_parser: str = "hermes"
    #: seconds one function-tool call may take; past it the model reads a timeout error as the call's result
    tool_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    #: most tool calls run per assistant message (parallel calls); the rest get an error observation
    max_tool_calls: Pos = 8
    #: worker processes for sync function tools (module-level functions; others run in a thread): a call past
    #: tool_timeout_s has its worker killed and replaced
    tool_workers: ToolWorkersSection = msgspec.field(default_factory=ToolWorkersSection)
    #: seconds an environment's ``reset`` or ``step`` may take; past it (or when it raises) the episode ends
    #: with ``finish_reason = "error"``
    env_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    #: the sandbox each agent loop creates (limits, network)
    sandbox: SandboxSection = msgspec.field(default_factory=SandboxSection)

    def __post_init__(self) -> None:
        from services.tasks.toolcalls import PARSERS

        if self.tool_parser not in PARSERS:
            raise ConfigError(f"config key services.rollout.agent.tool_parser: unknown parser {self.tool_parser!r}; "
                              f"the parsers are: {', '.join(sorted(PARSERS))}")


class EndpointSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The OpenAI- and Anthropic-compatible HTTP endpoint over the rollout's engine (services/rollout/endpoint.py).

    Each request is one call of a session (its id is the API key, or the ``/s/<session>`` path prefix);
    sessions are opened by the rollout for its episodes (or by code holding the endpoint)."""

    #: serve the endpoint beside the engine (off: nothing listens)
    enabled: bool = False
    #: the address it listens on (127.0.0.1: this host only; 0.0.0.0 / "::": every interface). Agents running as
    #: commands in sandboxes reach it through the sandbox's egress proxy, which refuses loopback: give those
    #: runs an address the sandbox service can reach (0.0.0.0, or this host's own address)
    host: str = "127.0.0.1"
    #: the address agents are given in their base URL (and that sandboxes' egress allows): "" = ``host``, or,
    #: when ``host`` is 0.0.0.0 / "::", this host's first non-loopback address (found at start)
    agent_host: str = ""
    #: the TCP port (0: a free port, chosen at start and logged)
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: the model id /v1/models lists and responses name ("": the run's [model] name); requests may name any
    served_model: str = ""
    #: most choices one request may ask for (``n``); more is refused with a 400
    max_n: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    #: completion tokens of a request that names no max_tokens (capped by what the context leaves)
    default_max_tokens: Pos = 512
    #: sessions held at once; opening one more is refused (close finished ones)
    max_sessions: Pos = 4096
    #: largest request body in bytes (larger: 413)
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 8 * 1024 * 1024


class WeightsSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A weightsync relay a rollout reads versions from (``[services.rollout] weights_from``)."""

    #: the relay's scope (``[services.weightsync] relay.scope``)
    scope: str
    #: the relay's store (absent: the [weights] store)
    store: StoreConfig | None = None


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: the inference engine, chosen by `type`: "auto" (default: vLLM for models >= 50 M parameters where
    #: vLLM is installed, else torch), "torch" or "vllm"
    engine: EngineConfig = msgspec.field(default_factory=AutoEngineConfig)
    #: prompt tickets worked on at once (each runs group_size episodes concurrently)
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
    #: failed attempts in a row to apply weight versions (the engine raising: a bad update, no room to stage
    #: it) before the rollout stops with an error so that its supervisor restarts it; while it fails it
    #: reports itself unhealthy (``rollout/weights_unhealthy``) and retries the version it holds
    max_weight_failures: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    #: seconds before the first retry of a failed weight apply; doubles on each retry, at most 60 s
    weight_retry_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 2.0
    #: budgets and tools of multi-turn episodes (environments, sandbox agents); single-turn tasks ignore it
    agent: AgentSection = msgspec.field(default_factory=AgentSection)
    #: the OpenAI/Anthropic-compatible endpoint over the engine, for black-box agents (off by default)
    endpoint: EndpointSection = msgspec.field(default_factory=EndpointSection)

    def weight_source(self, weights: TransportConfig) -> TransportConfig:
        """The transport this rollout reads versions with: ``weights`` (the run's ``[weights]``), or its scope
        and store replaced by ``weights_from`` (a relay's)."""
        if self.weights_from is None:
            return weights
        if not isinstance(weights, StoreTransportConfig):
            raise ConfigError(f"config key services.rollout.weights_from: a relay serves the store transport only, "
                              f"but [weights] type is {tag_of(weights)!r}")
        return msgspec.structs.replace(weights, scope=self.weights_from.scope,
                                       store=self.weights_from.store or weights.store)
