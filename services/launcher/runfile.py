"""The run file, typed: one msgspec struct for the whole file, and the rules that span services.

A run file says everything about a run once::

    [run]        id, dir, seed
    [model]      the policy every service loads (name, revision, dtype, cache_dir, chat_template)
    [task]       the task the run trains on: name and one options table, read by trainer, rollout and judge
    [weights]    how weight versions travel trainer -> engines (type = "store" | "broadcast" | "inproc")
    [nats]       the bus; [common] settings every service shares; [gang] all-or-nothing start
    [launcher]   which services ``rlbus run``/``rlbus up`` start, and how they are supervised
    [placement.<service>]  the GPUs and CPUs of each service's instances (services/launcher/placement.py)
    [services.<name>]   each service's own knobs only (no service reads another's section)

:class:`RunFile` decodes the merged tree (TOML, then ``RLBUS__`` variables, then ``--set``; a moved key
names its new place), :meth:`RunFile.check` applies the rules that span sections (the weight transport
against the launcher's layout, relays, autoscaling, the NATS cluster, the placement) and :meth:`RunFile.loaded` is one
service's view of it. ``docs/CONFIG.md`` is generated from these structs (``services/launcher/config_doc.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from services.echo.config import EchoConfig
from services.judge.config import JudgeConfig
from services.launcher.autoscale import CONSUMERS, AutoscaleRule
from services.rollout.config import RolloutConfig
from services.runtime.config import (
    CommonSection,
    ConfigError,
    DistillSection,
    Loaded,
    ModelSection,
    NatsSection,
    RunSection,
    TaskSection,
    convert,
    load_tree,
    tag_of,
    weights_tree,
)
from services.runtime.gang import GangSection
from services.runtime.placement import ServicePlacement
from services.runtime.weights_config import (
    BroadcastConfig,
    InprocConfig,
    StoreTransportConfig,
    TransportConfig,
    VllmTransferConfig,
)
from services.sandbox.config import SandboxConfig
from services.teacher.config import TeacherConfig
from services.tracker.config import TrackerConfig
from services.trainer.config import TrainerConfig
from services.weightsync.config import WeightsyncConfig


class LauncherSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How ``rlbus run`` / ``rlbus up`` start and supervise the run's services (section ``[launcher]``)."""

    #: instances to start per service, e.g. { trainer = 1, rollout = 2 }; "trainer+rollout" colocates
    #: services in one process
    services: dict[str, int] = {}
    #: start an embedded nats-server (false: use [nats] url as given)
    embedded_nats: bool = True
    #: preferred port of the embedded server (a free one is taken if it is busy)
    nats_port: int = 4222
    #: embedded NATS as a local JetStream cluster of this many nodes (routes on 127.0.0.1; 0 or 1: one
    #: server). [nats] replicas defaults to the cluster size (3 or 5) when the run file does not set it
    nats_cluster: int = 0
    #: restart services that exit unexpectedly
    restart: bool = True
    #: give up on a service after this many restarts within restart_window_s
    max_restarts: int = 5
    #: seconds over which restarts are counted against max_restarts
    restart_window_s: float = 300.0
    #: seconds services get to drain on stop before SIGKILL
    stop_timeout_s: float = 20.0
    #: a running service silent (no heartbeat) this long is killed and restarted (0: off)
    heartbeat_timeout_s: float = 30.0
    #: autoscaler (off when empty): service -> { min, max, target_pending, period_s, cooldown_s }, sizing
    #: rollout or judge workers on their consumer's lag like KEDA's NATS JetStream scaler
    #: (services/launcher/autoscale.py)
    autoscale: dict[str, AutoscaleRule] = {}
    #: embedded server: one NATS user per service with minimal permissions and generated passwords
    #: (services/launcher/auth.py; credentials under <run dir>/auth); false: an open server
    auth: bool = True

    def parts(self) -> dict[str, list[str]]:
        """Each started process's services ("trainer+rollout" -> ["trainer", "rollout"]), count > 0 only."""
        return {name: name.split("+") for name, count in self.services.items() if count > 0}

    def count(self, service: str) -> int:
        """Processes that run ``service`` (alone or colocated)."""
        return sum(self.services[name] for name, parts in self.parts().items() if service in parts)


class ServicesSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Each service's own knobs (``[services.<name>]``). Facts about the whole run are not here: they are
    [model], [task] and [weights]."""

    #: the trainer: batch, pacing, loss, optimiser, evaluation, devices, checkpoints
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    #: rollout workers: the inference engine, tickets at once, agent-loop budgets
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    #: judges: graders per task, bounds on the tasks' own code
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    #: sandbox workers: isolation backend, limits, images
    sandbox: SandboxConfig = msgspec.field(default_factory=SandboxConfig)
    #: weightsync: retention of the trainer's versions and relays near engines
    weightsync: WeightsyncConfig = msgspec.field(default_factory=WeightsyncConfig)
    #: the tracker: metrics and samples into experiment trackers
    tracker: TrackerConfig = msgspec.field(default_factory=TrackerConfig)
    #: the echo service (a request/reply example and bus check)
    echo: EchoConfig = msgspec.field(default_factory=EchoConfig)
    #: the teacher of on-policy distillation: a model that scores the student's sampled tokens
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)


#: the services this struct types; others come from the ``rlbus.services`` entry points (their sections are
#: typed by their own config class when they are started)
BUILTIN_SERVICES = tuple(ServicesSection.__struct_fields__)


class RunFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole run file."""

    #: the run's id, directory and seed
    run: RunSection = msgspec.field(default_factory=RunSection)
    #: the policy every service loads
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    #: the task (environment) the run trains on
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    #: how weight versions travel from the trainer to the engines, chosen by ``type``: "store" (the default:
    #: anchors + deltas in a blob store, engines pull), "broadcast" (torch.distributed, rendezvous over the
    #: bus), "inproc" (trainer and rollout colocated: ``[launcher] services = { "trainer+rollout" = 1 }``)
    weights: TransportConfig = msgspec.field(default_factory=StoreTransportConfig)
    #: on-policy distillation: a teacher service scores the samples, advantages per token
    distill: DistillSection = msgspec.field(default_factory=DistillSection)
    #: the bus
    nats: NatsSection = msgspec.field(default_factory=NatsSection)
    #: settings every service shares
    common: CommonSection = msgspec.field(default_factory=CommonSection)
    #: all-or-nothing start of the run's roles
    gang: GangSection = msgspec.field(default_factory=GangSection)
    #: what rlbus run / rlbus up start and how they supervise it
    launcher: LauncherSection = msgspec.field(default_factory=LauncherSection)
    #: per service of [launcher] services ("trainer+rollout" included): its instances' GPUs and CPUs, e.g.
    #: { trainer = { gpus = [0, 1, 2, 3], cpus = "0-31" }, rollout = { gpus = [4, 5, 6, 7] } }; the launcher
    #: starts each with CUDA_VISIBLE_DEVICES, CPU affinity and thread counts from it (CPU-only services
    #: always get CUDA_VISIBLE_DEVICES=""), the deploy files request the same counts
    placement: dict[str, ServicePlacement] = {}
    #: each service's own knobs
    services: ServicesSection = msgspec.field(default_factory=ServicesSection)

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> RunFile:
        """Decode a merged raw tree; errors name the key and the expected type. Sections of services that
        only an entry point knows are left to that service (typed when it starts)."""
        tree = dict(tree)
        if "weights" in tree:
            tree["weights"] = weights_tree(tree["weights"])
        services = tree.get("services")
        if isinstance(services, dict):
            from services.launcher import registry

            plugins = set(registry.names()) - set(BUILTIN_SERVICES)
            tree["services"] = {k: v for k, v in services.items() if k not in plugins}
        return convert(tree, cls, "")

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None,
             overrides: Sequence[str] = ()) -> RunFile:
        """The run file at ``path`` (None: every default), then ``RLBUS__`` variables, then ``key=value``
        overrides."""
        return cls.from_tree(load_tree(path, env, overrides))

    def loaded(self, service: str) -> Loaded:
        """What ``service`` (a builtin) sees: the shared sections and its own."""
        if service not in BUILTIN_SERVICES:
            raise ConfigError(f"service {service!r} has no section in this run file's struct")
        return Loaded(run=self.run, nats=self.nats, common=self.common, model=self.model, task=self.task,
                      weights=self.weights, distill=self.distill, service=getattr(self.services, service),
                      gang=self.gang)

    def resolved(self) -> dict[str, Any]:
        """Every key with its value, defaults included (``config.resolved.json``, ``rlbus config show``)."""
        return msgspec.to_builtins(self)

    # --- rules that span sections ----------------------------------------------------------------

    def check(self) -> list[str]:
        """Check the rules between sections for the launcher's layout; returns the overrides the launcher
        derives (``weights.world_size=N`` for a broadcast), which every service it starts gets."""
        self._check_layout()
        self._check_distill()
        self._check_cluster()
        if self.model.chat_template:
            from services.lib.chat_template import read_chat_template

            read_chat_template(self.model.chat_template)
        derived = self._check_weights()
        from services.launcher.placement import Layout

        Layout(self).check()
        self._check_sleep_level()
        return derived

    def _check_sleep_level(self) -> None:
        """vLLM's level-2 sleep drops the weights: only a full update after every step may refill them."""
        engine = self.services.rollout.engine
        if getattr(engine, "sleep_level", 1) == 2 and (not isinstance(self.weights, InprocConfig)
                                                       or self.services.trainer.lora is not None):
            raise ConfigError("config key services.rollout.engine.sleep_level is 2 (the weights are dropped while "
                              "the trainer steps), which needs a full update after every step: the inproc weight "
                              f"transport (colocated trainer+rollout) without LoRA; [weights] type is "
                              f"{tag_of(self.weights)!r}{', with LoRA' if self.services.trainer.lora else ''}: "
                              "set sleep_level = 1")

    def _check_layout(self) -> None:
        launcher = self.launcher
        if not launcher.services:
            raise ConfigError("config key launcher.services: no services to start (e.g. services = { echo = 2 })")
        for name, count in launcher.services.items():
            if count < 0:
                raise ConfigError(f"config key launcher.services.{name}: expected a count >= 0, got {count}")
        for name, rule in launcher.autoscale.items():
            if name not in CONSUMERS or name not in launcher.services:
                raise ConfigError(f"config key launcher.autoscale.{name}: only services of this run's layout that "
                                  f"work from a consumer autoscale ({', '.join(sorted(CONSUMERS))})")
            if rule.min > rule.max:
                raise ConfigError(f"config key launcher.autoscale.{name}: min ({rule.min}) > max ({rule.max})")

    def _check_cluster(self) -> None:
        size = self.launcher.nats_cluster
        if size < 0 or size > 7:
            raise ConfigError(f"config key launcher.nats_cluster: expected 0..7 nodes, got {size}")
        nodes = max(size, 1) if self.launcher.embedded_nats else None
        if nodes is not None and self.nats.replicas > nodes:
            raise ConfigError(f"config key nats.replicas is {self.nats.replicas}, but the embedded NATS has {nodes} "
                              f"node(s): set launcher.nats_cluster = {self.nats.replicas} (or rlbus up "
                              f"--nats-cluster {self.nats.replicas}), or nats.replicas = 1")

    def _check_distill(self) -> None:
        """Distillation needs a teacher to ask and a model for it; a teacher without distillation idles."""
        if not self.distill.enabled:
            return
        if self.launcher.count("teacher") == 0:
            raise ConfigError("config key distill.enabled: distillation needs a teacher service: add it to "
                              "launcher.services (e.g. teacher = 1) and name its model in services.teacher.model")
        if not self.services.teacher.model:
            raise ConfigError("config key services.teacher.model: distill.enabled needs the teacher's model")
        trainer = self.services.trainer
        if trainer.loss.type == "gspo":
            raise ConfigError("config keys distill.enabled and services.trainer.loss.type: GSPO's one ratio per "
                              "completion does not go with distillation's per-token advantages; use loss.type = "
                              '"grpo", "dr_grpo" or "cispo", or turn distillation off')
        if trainer.dynamic_sampling and self.distill.reward_weight == 0:
            raise ConfigError("config keys services.trainer.dynamic_sampling and distill.reward_weight: dynamic "
                              "sampling drops groups whose rewards are all equal, which still carry a distillation "
                              "signal when the reward is not used (reward_weight = 0); turn one of them off")

    def _check_weights(self) -> list[str]:
        """The weight transport against the layout: inproc needs the trainer and rollout in one process, a
        broadcast group's size follows the rollout engines started, relays need the store transport."""
        weights, launcher, parts = self.weights, self.launcher, self.launcher.parts()
        rollouts = launcher.count("rollout")
        trainers = [n for n, ps in parts.items() if "trainer" in ps]
        if not isinstance(weights, StoreTransportConfig):
            if self.services.rollout.weights_from is not None:
                raise ConfigError("config key services.rollout.weights_from: a relay serves the store transport "
                                  f"only, but [weights] type is {tag_of(weights)!r}")
            if "weightsync" in {p for ps in parts.values() for p in ps}:
                raise ConfigError(f"weightsync keeps and relays versions of the store transport; [weights] type is "
                                  f"{tag_of(weights)!r}: leave weightsync out of [launcher] services")
        relay = self.services.weightsync.relay
        if isinstance(weights, StoreTransportConfig) and relay is not None and relay.scope == weights.scope:
            raise ConfigError(f"config key services.weightsync.relay.scope: {relay.scope!r} is the trainer's scope "
                              "(weights.scope); a relay needs its own scope")
        if not trainers or not rollouts:
            return []
        if isinstance(weights, VllmTransferConfig):
            return self._check_vllm_weights(weights, rollouts, trainers)
        if isinstance(weights, InprocConfig):
            if any("rollout" not in parts[n] for n in trainers) or any(
                    "trainer" not in ps for ps in parts.values() if "rollout" in ps):
                raise ConfigError('the inproc weight transport needs the trainer and rollout colocated in one '
                                  'process: [launcher] services = { "trainer+rollout" = 1, ... }')
            if sum(launcher.services[n] for n in trainers) != 1:
                raise ConfigError("the inproc weight transport serves one trainer+rollout process; set its count to 1")
        if isinstance(weights, BroadcastConfig):
            if weights.world_size == 0:
                return [f"weights.world_size={1 + rollouts}"]
            if weights.world_size != 1 + rollouts:
                raise ConfigError(f"config key weights.world_size is {weights.world_size}, but this launcher starts "
                                  f"{rollouts} rollout engine(s): set it to {1 + rollouts} (trainer + engines), or "
                                  "leave it out and the launcher sets it")
        return []

    def _check_vllm_weights(self, weights: VllmTransferConfig, rollouts: int, trainers: list[str]) -> list[str]:
        """vLLM's weight transfer: vllm engines; ipc colocated in one process; nccl waits for the engines started."""
        engine = tag_of(self.services.rollout.engine)
        if engine not in ("vllm", "auto"):
            raise ConfigError(f'[weights] type = "vllm" needs services.rollout.engine type = "vllm", not {engine!r}')
        parts = self.launcher.parts()
        if weights.backend == "ipc":
            if any("rollout" not in parts[n] for n in trainers) or sum(self.launcher.services[n] for n in trainers) != 1:
                raise ConfigError('weights.backend = "ipc" hands CUDA IPC handles to a colocated engine: [launcher] '
                                  'services = { "trainer+rollout" = 1, ... }')
            return []
        if weights.engines == 0:
            return [f"weights.engines={rollouts}"]
        if weights.engines != rollouts:
            raise ConfigError(f"config key weights.engines is {weights.engines}, but this launcher starts {rollouts} "
                              f"rollout engine(s): set it to {rollouts}, or leave it out and the launcher sets it")
        return []

    # --- what the launcher provisions ------------------------------------------------------------

    def weight_buckets(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The weight KV buckets and object stores (bucket, storage) the run's store transport will open:
        one per scope (the trainer's, and the weightsync relay's)."""
        from proto import weights as wire
        from services.runtime.weights_config import ObjStoreConfig

        if not isinstance(self.weights, StoreTransportConfig):
            return [], []
        scopes = [self.weights.scope]
        relay = self.services.weightsync.relay
        if relay is not None:
            scopes.append(relay.scope)
        kv = [wire.kv_bucket(s) for s in scopes]
        store = self.weights.store
        if not isinstance(store, ObjStoreConfig):
            return kv, []
        if store.bucket:
            return kv, [(store.bucket, store.storage)]
        return kv, [(wire.object_bucket(s), store.storage) for s in scopes]


async def provision_run(js: Any, runfile: RunFile) -> None:
    """What the launcher (or ``rlbus provision``) creates before services start: every catalog stream and
    bucket, brought to the catalog with [nats] replicas (never lowered), and the weight buckets."""
    from proto import catalog
    from services.runtime import bus

    await bus.provision_all(js, update=True)
    kv, objects = runfile.weight_buckets()
    for bucket in kv:
        await bus.ensure_kv(js, catalog.KVDef(bucket=bucket, history=1, description="rlbus weight versions"),
                            update=True)
    for bucket, storage in objects:
        await bus.ensure_object_store(js, bucket, storage=storage, description="rlbus weight blobs",
                                      update=True)
