"""Typed configuration: a TOML file, then environment variables, then CLI flags.

A run file looks like::

    [run]
    id = "demo"              # run id: scopes every subject, consumer and key
    dir = "runs/demo"        # where logs, metrics, checkpoints go

    [nats]
    url = "nats://127.0.0.1:4222"

    [launcher]
    services = { trainer = 1, rollout = 1, judge = 1 }

    [services.rollout]       # one section per service, typed by that service
    concurrency = 256

Environment variables override the file with ``RLBUS__`` + the key path in
upper case joined by double underscores (``RLBUS__SERVICES__ROLLOUT__CONCURRENCY=64``);
CLI ``--set services.rollout.concurrency=64`` overrides both. Values from the
environment and the CLI are parsed as TOML values (``64``, ``true``,
``[1, 2]``, ``"text"``) with a bare word taken as a string. Any key that is
unknown or of the wrong type stops start-up with a :class:`ConfigError` naming
the key and the expected type; a key that moved (:data:`MOVED_KEYS`) names the
key that replaced it, whichever of the three sources set it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

# ConfigError is defined beside the weight transports' config (which this module reads) and is the one class
# every configuration error of rlbus raises
from services.runtime.weights_config import ConfigError, StoreTransportConfig, TransportConfig

T = TypeVar("T")
ENV_PREFIX = "RLBUS__"


#: one value of a task's options (``task_options`` of the trainer, the rollout and the judge): a scalar, a
#: list of scalars (``reward = ["mypkg.rewards:exact", "rlbus.rewards:format"]``, ``stop = ["\\n"]``) or
#: one level of table (``config = { min_terms = 2 }``: settings the task hands on to a library); which keys
#: take a list or a table, and whether a comma-separated string is read as a list, is the task's to say
TaskScalar = int | float | str | bool
TaskOption = TaskScalar | list[TaskScalar] | dict[str, TaskScalar | list[TaskScalar]]


class RunSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: run id: a NATS subject token scoping every subject, consumer and key of this run
    id: str = "default"
    #: run directory: logs, metrics, checkpoints, the embedded NATS store
    dir: str = "runs/default"
    #: seed for everything random in the run
    seed: int = 0


class NatsSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: server URL, or several (a list, or one string with commas) of one NATS cluster: the client
    #: connects to any of them and fails over to another when its server goes away
    url: str | list[str] = "nats://127.0.0.1:4222"
    #: JetStream replicas of every stream, KV bucket and object store the run creates (consumers take
    #: their stream's): 1 on a single server, 3 or 5 on a cluster of at least that many nodes. Existing
    #: streams are never lowered (an operator's R3 stream stays R3 under replicas = 1)
    replicas: Literal[1, 3, 5] = 1
    #: user / password (per-service users come from deploy/nats)
    user: str | None = None
    password: str | None = None
    #: prefix of this client's reply subjects (per-service users get a private one: _INBOX_<service>)
    inbox_prefix: str = "_INBOX"
    #: a .creds file (JWT auth) instead of user/password
    creds_file: str | None = None
    #: TLS: CA bundle, client certificate and key (enables TLS when set)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: seconds for the first connection attempt
    connect_timeout_s: float = 5.0
    #: seconds between reconnect attempts (nats-py adds jitter)
    reconnect_wait_s: float = 1.0
    #: -1: reconnect forever (a restarted server is waited for)
    max_reconnect_attempts: int = -1
    #: seconds between client pings; a server that misses max_outstanding_pings of them in a row is taken
    #: as gone and the client reconnects (to another server of the cluster), so a cut link is noticed
    #: within about ping_interval_s * max_outstanding_pings
    ping_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 20.0
    max_outstanding_pings: Annotated[int, msgspec.Meta(ge=1)] = 3

    def servers(self) -> list[str]:
        """The server URLs, in order (``url`` as a list or comma separated)."""
        urls = self.url if isinstance(self.url, list) else self.url.split(",")
        out = [u.strip() for u in urls if u.strip()]
        if not out:
            raise ConfigError("config key nats.url: no server URL given")
        return out


class ModelSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The policy every service of the run loads (section ``[model]``): trainer, rollout engines, replay."""

    #: builtin model (tiny-addition, smollm2), a Hugging Face directory (with config.json) or a Hub id already
    #: in the local Hugging Face cache (nothing is downloaded at run time)
    name: str = "tiny-addition"
    #: revision of a Hub id (empty: the one in ``name`` after ``@``, else the cached default)
    revision: str = ""
    #: training precision: float32, or bfloat16 mixed precision (bf16 compute, fp32 master weights and
    #: optimiser moments; weights are sent to the engines in bf16); "auto": bfloat16 where the trainer
    #: runs on a CUDA GPU with bf16, else float32. Engines choose their own dtype
    #: (``[services.rollout] engine.dtype``)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: where builtin models are built and cached (empty: ~/.cache/rlbus or $RLBUS_CACHE)
    cache_dir: str = ""
    #: a Jinja chat template file that replaces the tokenizer's own in the trainer and the rollout (empty: the
    #: model's own), e.g. examples/chat_templates/chatml_tools.jinja for tool calls with SmolLM2; checked at
    #: start-up (it must render tools); a relative path is taken from the working directory
    chat_template: str = ""


class TaskMixEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One environment of a mixture (``[[task.mix]]``): a task, its options and its share of the training
    prompts."""

    #: task name from the task registry; also the environment's name in tickets, metrics
    #: (``train/<name>/reward_mean``, ``eval/<name>/reward``) and the judge's ``[services.judge.graders.<name>]``
    name: str
    #: the task's options, passed to its factory as keyword arguments (as ``[task.options]`` for one task)
    options: dict[str, TaskOption] = {}
    #: sampling weight: this environment's expected share of the training prompts is weight / (sum of weights)
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0


#: the one task's name when ``[task]`` names none
DEFAULT_TASK = "addition"


class TaskSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The task (environment) the run trains on (section ``[task]``), read alike by trainer, rollout and judge:
    one task (``name`` and ``options``), or a mixture of several (``[[task.mix]]``), each with a sampling weight."""

    #: task name from the task registry (``rlbus services`` lists them), e.g. addition, dataset, coding
    name: str = DEFAULT_TASK
    #: the task's options, passed to its factory as keyword arguments (``[task.options]``); which keys a
    #: task takes is the task's to say (services/tasks/: a dataset's path, columns and rewards, ...)
    options: dict[str, TaskOption] = {}
    #: several environments in one run (``[[task.mix]]`` entries with name, options, weight): each training
    #: prompt comes from one of them, drawn by weight from the run's seed; each is evaluated and reported on
    #: its own. Unset: the one task of ``name`` and ``options`` (then leave those two unset). One entry per task
    mix: list[TaskMixEntry] | None = None

    def __post_init__(self) -> None:
        if self.mix is None:
            return
        if not self.mix:
            raise ValueError("task.mix is empty: list at least one environment ([[task.mix]] name = ...), or "
                             "remove it and name the one task in task.name")
        if self.name != DEFAULT_TASK or self.options:
            raise ValueError("task.mix is set together with task.name / task.options: with a mixture, each "
                             "[[task.mix]] entry names its task and options; remove task.name and task.options")
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.mix):
            if entry.name in seen:
                raise ValueError(f"task.mix[{i}].name: task {entry.name!r} is already task.mix[{seen[entry.name]}]; "
                                 "one entry per task (merge their weights)")
            seen[entry.name] = i

    def entries(self) -> list[TaskMixEntry]:
        """The run's environments: the mixture's entries, or the one task as a mixture of one."""
        if self.mix is not None:
            return list(self.mix)
        return [TaskMixEntry(name=self.name, options=dict(self.options))]

    def key_of(self, index: int) -> str:
        """The config key of environment ``index`` (``task.mix[i]``, or ``task`` for the one task)."""
        return f"task.mix[{index}]" if self.mix is not None else "task"

    def options_for(self, name: str) -> dict[str, TaskOption]:
        """The options to build task ``name`` with: those of its entry (the one task's, or its mixture
        entry's), none for another (a message naming a task this run does not train on gets that task's
        defaults)."""
        return next((dict(e.options) for e in self.entries() if e.name == name), {})


class DistillSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """On-policy distillation (section ``[distill]``), read by the judge and the trainer: the teacher service
    (``[services.teacher]``) scores every sample's tokens, and each token's advantage is
    ``kl_coef * (log pi_teacher - log pi_student) + reward_weight * (the group advantage)``."""

    #: on: the judge asks the teacher for every sample's logprobs, and the trainer trains on per-token advantages
    #: (a sample without teacher logprobs is dropped with the reason, never trained)
    enabled: bool = False
    #: weight of the negative reverse KL to the teacher, per token
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    #: weight of the task's group-normalised advantage mixed in (0: pure distillation)
    reward_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: seconds a group waits for the teacher (asking again while none answers) before its samples are published
    #: failed ("teacher logprobs unavailable: ..."), which the trainer drops with that reason
    wait_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    #: seconds one request to the teacher may take
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0

    def __post_init__(self) -> None:
        if self.enabled and self.kl_coef == 0 and self.reward_weight == 0:
            raise ValueError("distill.kl_coef and distill.reward_weight are both 0: every advantage would be 0; "
                             "set distill.kl_coef > 0 (or turn distill.enabled off)")


class CommonSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings every service shares (section ``[common]``)."""

    #: seconds between heartbeats
    heartbeat_s: float = 2.0
    #: on SIGTERM, seconds in-flight work may take to finish before it is abandoned (and redelivered)
    drain_timeout_s: float = 10.0
    #: logging level name
    log_level: str = "INFO"
    #: largest message accepted, in bytes (bigger ones are dead-lettered)
    max_message_bytes: int = 4 * 1024 * 1024
    #: Prometheus endpoint of each service at http://<host>:PORT/metrics (0: none); services sharing a host
    #: take the next free port above it (each names its port in its log and heartbeat)
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: JetStream publishes a service keeps in flight at once where the consumers do not rely on their order
    #: (the trainer's tickets and outcome batches, a group message's parts): sent together, their acks awaited
    #: together (``bus.in_window``); 1: one at a time, each ack awaited before the next is sent
    publish_window: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32


#: keys that were replaced: old dotted path -> the key (and form) that replaced it. Checked on the merged
#: tree before anything is decoded, so a TOML file, an RLBUS__ variable and a --set override all get it.
MOVED_KEYS: dict[str, str] = {
    # the facts of the whole run, once (one [model], [task] and [weights] section every service reads)
    **{f"services.{svc}.{key}": new for svc in ("trainer", "rollout", "judge") for key, new in (
        ("model", "model.name ([model] name = ...: one model for the whole run)"),
        ("cache_dir", "model.cache_dir ([model] cache_dir = ...)"),
        ("task", "task.name ([task] name = ...)"),
        ("task_options", "task.options ([task.options]: one table, read by trainer, rollout and judge)"),
        ("transport", "weights ([weights] type = \"store\" | \"broadcast\" | \"inproc\", with the transport's "
                      "fields: one transport for the whole run)"),
    )},
    "services.trainer.dtype": "model.dtype ([model] dtype = ...)",
    # the trainer's keys in groups ([services.trainer.loss], .optim, .sampling, .eval, .devices)
    **{f"services.trainer.{key}": f"services.trainer.{group}.{key.removeprefix(group + '_')} ([services.trainer."
       f"{group}] {key.removeprefix(group + '_')} = ...)" for group, keys in (
        ("loss", "normalize_std clip_low clip_high kl_coef is_mode is_cap aggregation staleness_decay"),
        ("optim", "lr weight_decay max_grad_norm lr_schedule lr_warmup_steps ppo_epochs minibatches "
                  "micro_batch_size max_tokens_per_micro_batch gradient_checkpointing"),
        ("sampling", "max_new_tokens temperature top_p"),
        ("eval", "eval_every eval_prompts eval_samples eval_temperature"),
        ("devices", "device ref_device world_size rank_timeout_s num_threads"),
    ) for key in keys.split()},
    "services.weightsync.upstream_scope": "weights.scope (the trainer's transport, [weights])",
    "services.weightsync.upstream_store": "weights.store (the trainer's transport, [weights])",
    "services.weightsync.hmac_key_env": "weights.hmac_key_env (the trainer's transport, [weights])",
    # older names of the weight transport's keys
    "services.trainer.store": 'weights.store ([weights] type = "store", store = {...})',
    "services.trainer.weights": 'weights.encoding ([weights] type = "store", encoding = { anchor_every = ..., dtype = ... })',
    "services.rollout.store": 'weights.store ([weights] type = "store", store = {...})',
    "services.rollout.weights_recheck_s": 'weights.recheck_s ([weights] type = "store", recheck_s = ...)',
}


def tag_of(value: msgspec.Struct) -> str:
    """The ``type`` a tagged config struct was chosen by (``"store"``, ``"vllm"``, ...)."""
    return str(type(value).__struct_config__.tag)


def check_moved_keys(tree: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` naming the replacement of the first moved key ``tree`` still sets."""
    for old, new in MOVED_KEYS.items():
        node: Any = tree
        for key in old.split("."):
            if not isinstance(node, Mapping) or key not in node:
                break
            node = node[key]
        else:
            raise ConfigError(f"config key {old} was replaced by {new}")


def parse_value(text: str) -> Any:
    """Parse an env/CLI value as a TOML value; a bare word stays a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"config key {'.'.join(path)}: {key} is a value, not a section")
        node = nxt
    node[path[-1]] = value


def load_tree(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """The merged raw config tree: file, then ``RLBUS__...`` env vars, then ``key=value`` overrides
    (a moved key raises :class:`ConfigError` naming its replacement)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    env = os.environ if env is None else env
    for name, value in sorted(env.items()):
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            keys = [k.lower() for k in name[len(ENV_PREFIX):].split("__")]
            _set_path(tree, keys, parse_value(value))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        _set_path(tree, key.strip().split("."), parse_value(value.strip()))
    check_moved_keys(tree)
    return tree


def convert(section: Any, cls: type[T], key: str) -> T:
    """Convert a raw section into ``cls``; errors name the full key and the expected type."""
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"config key {key}: expected a section (table), got {type(section).__name__}")
    try:
        return msgspec.convert(section, cls)
    except msgspec.ValidationError as e:
        text = str(e)
        reason, _, where = text.partition(" - at `")
        field = where.rstrip("`").removeprefix("$").lstrip(".")
        full = ".".join(k for k in (key, field) if k)
        if reason.startswith("Object contains unknown field"):
            bad = reason.split("`")[1] if "`" in reason else "?"
            full = ".".join(k for k in (full, bad) if k)
            raise ConfigError(f"config key {full}: unknown key (check the spelling; see --help)") from None
        if full and reason.startswith(full + "."):  # a struct's own rule that names its key (a __post_init__)
            raise ConfigError(f"config key {reason}") from None
        raise ConfigError(f"config key {full}: {reason.replace('Expected', 'expected')}") from None


def weights_tree(section: Any) -> Any:
    """The raw ``[weights]`` section with its ``type`` defaulted to ``"store"`` (absent: the default store)."""
    if section is None:
        return {"type": "store"}
    if isinstance(section, dict) and "type" not in section:
        return {"type": "store", **section}
    return section


class Loaded(msgspec.Struct, kw_only=True):
    """What a service sees of the run file once it is resolved: the shared sections, typed, and its own
    section (``service``, typed by the service's config class). A service never sees another's section."""

    run: RunSection
    nats: NatsSection
    common: CommonSection
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    #: how weight versions travel from the trainer to the engines (``[weights]``)
    weights: TransportConfig = msgspec.field(default_factory=StoreTransportConfig)
    #: on-policy distillation (``[distill]``): read by the judge and the trainer
    distill: DistillSection = msgspec.field(default_factory=DistillSection)
    service: Any = None
    gang: Any = None  # services.runtime.gang.GangSection


def load_service_config(
    service: str,
    cls: type[Any],
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Loaded:
    from services.runtime.gang import GangSection

    tree = load_tree(path, env, overrides)
    services = tree.get("services", {})
    if not isinstance(services, dict):
        raise ConfigError("config key services: expected a section (table)")
    return Loaded(
        run=convert(tree.get("run"), RunSection, "run"),
        nats=convert(tree.get("nats"), NatsSection, "nats"),
        common=convert(tree.get("common"), CommonSection, "common"),
        model=convert(tree.get("model"), ModelSection, "model"),
        task=convert(tree.get("task"), TaskSection, "task"),
        weights=convert(weights_tree(tree.get("weights")), TransportConfig, "weights"),  # type: ignore[arg-type]
        distill=convert(tree.get("distill"), DistillSection, "distill"),
        service=convert(services.get(service), cls, f"services.{service}"),
        gang=convert(tree.get("gang"), GangSection, "gang"),
    )
