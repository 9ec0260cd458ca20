"""The run file's ``[placement]`` against its layout: checked at start-up, applied to each process started.

``[placement.<service>]`` (:class:`~services.runtime.placement.ServicePlacement`) gives a service of
``[launcher] services`` its GPUs and CPUs; instance ``i`` takes the ``i``-th slice. :class:`Layout` checks
the rules that span sections, naming the keys:

* a placement names a service of the layout; GPUs and CPUs are not listed twice; the slices cover every
  instance the launcher (or its autoscaler, up to its ``max``) may start;
* a CPU-only process (judge, sandbox, weightsync, tracker, echo; a torch engine or trainer on ``cpu``) is
  given no GPU, and always starts with ``CUDA_VISIBLE_DEVICES=""`` so it never holds memory on one;
* a placed process's explicit torch thread count (``services.trainer.devices.num_threads``, a torch engine's
  ``num_threads``) fits its CPUs (each rank's share for a rank group); 0 follows the placement;
* the trainer's ranks fit its GPUs (one each) and a ``cuda:N`` device is among them; a rollout's engine
  device and vLLM's ``tensor_parallel_size`` fit its GPUs;
* a trainer and a separate vLLM engine (or two vLLM engines) never share a GPU: vLLM takes most of a GPU's
  memory and refuses to start on one that is not free. Colocated (``"trainer+rollout"``: one process, one
  placement) they time-share it instead.

Then :meth:`Layout.for_instance` says what one process starts with (:class:`Placed`): its environment
and the CPUs the child pins itself to before ``exec``. GPU indices are those the launcher sees: into its own
``CUDA_VISIBLE_DEVICES`` when that is set. The deploy files carry the same counts as device requests
(:meth:`Layout.requests`; tests/deploy checks them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.lib.engine.config import AutoEngineConfig, TorchEngineConfig, VllmEngineConfig
from services.runtime.config import ConfigError
from services.runtime.natsd import die_with_parent
from services.runtime.placement import ServicePlacement, process_env, slots, split_evenly

if TYPE_CHECKING:
    from services.launcher.runfile import RunFile

#: services that never use a GPU
CPU_ONLY = frozenset({"judge", "sandbox", "weightsync", "tracker", "echo"})


@dataclass(frozen=True)
class Placed:
    """What one process starts with."""

    #: variables added to its environment (CUDA_VISIBLE_DEVICES, thread counts, its CPU list)
    env: dict[str, str] = field(default_factory=dict)
    #: CPUs it is pinned to ([]: not pinned)
    cpus: list[int] = field(default_factory=list)

    def preexec(self) -> Callable[[], None]:
        """The child's ``preexec_fn``: die with the launcher, then pin to the CPUs (before ``exec``, so every
        thread the service later starts inherits the mask)."""
        cpus = set(self.cpus)

        def run() -> None:
            die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)
        return run


class Layout:
    """A run file's placement against its ``[launcher]`` layout."""

    def __init__(self, runfile: RunFile) -> None:
        self.runfile = runfile
        self.entries: Mapping[str, ServicePlacement] = runfile.placement
        launcher = runfile.launcher
        self.instances = {name: max(count, launcher.autoscale[name].max if name in launcher.autoscale else 0)
                          for name, count in launcher.services.items()}

    # --- what each service is --------------------------------------------------------------------

    def cpu_only(self, name: str) -> bool:
        """Whether every part of process ``name`` ("trainer+rollout": both) runs on CPU only."""
        return all(self._part_cpu_only(part) for part in name.split("+"))

    def _part_cpu_only(self, part: str) -> bool:
        services = self.runfile.services
        if part == "trainer":
            return services.trainer.devices.device == "cpu"
        if part == "rollout":
            engine = services.rollout.engine
            return isinstance(engine, TorchEngineConfig) and engine.device == "cpu"
        return part in CPU_ONLY

    def _holds_whole_gpu(self, name: str) -> str | None:
        """What in process ``name`` needs its GPUs to itself ("trainer", "vllm"; None: nothing)."""
        parts = name.split("+")
        engine = self.runfile.services.rollout.engine
        if "rollout" in parts and isinstance(engine, VllmEngineConfig | AutoEngineConfig):
            return "vllm" if "trainer" not in parts else "trainer"  # colocated: the trainer hands it back
        return "trainer" if "trainer" in parts and not self._part_cpu_only("trainer") else None

    # --- the rules ----------------------------------------------------------------------------------

    def gpu_slots(self, name: str) -> list[list[int]] | None:
        """Each instance's GPUs of process ``name`` (None: not placed, inherited)."""
        entry = self.entries.get(name)
        if entry is None or entry.gpus is None:
            return None
        return slots(entry.gpus, entry.gpus_per_instance, self.instances[name], f"placement.{name}.gpus")

    def cpu_slots(self, name: str) -> list[list[int]]:
        entry = self.entries.get(name)
        if entry is None:
            return []
        return slots(entry.cpu_list(f"placement.{name}"), entry.cpus_per_instance, self.instances[name],
                     f"placement.{name}.cpus")

    def check(self) -> None:
        """Every rule of the module docstring; raises ConfigError naming the keys."""
        self.runfile.services.trainer.devices.check()
        layout = ", ".join(self.instances) or "none"
        for name, entry in self.entries.items():
            if name not in self.instances:
                raise ConfigError(f"config key placement.{name}: not a service of [launcher] services ({layout})")
            if entry.gpus is not None and len(set(entry.gpus)) != len(entry.gpus):
                raise ConfigError(f"config key placement.{name}.gpus: a GPU is listed twice ({entry.gpus})")
            gpus = self.gpu_slots(name)
            self.cpu_slots(name)
            if gpus and self.cpu_only(name):
                raise ConfigError(f"config key placement.{name}.gpus: {name} runs on CPU only (it always starts "
                                  "with CUDA_VISIBLE_DEVICES=\"\"); give its GPUs to the trainer or an engine")
            if gpus is not None:
                self._check_devices(name, len(gpus[0]) if gpus else 0)
            self._check_threads(name)
        self._check_overlap()

    def _check_threads(self, name: str) -> None:
        """A placed process's explicit torch thread counts fit its CPUs: torch's intra-op pool follows the
        placement (OMP_NUM_THREADS) only where the service leaves its own count at 0; more threads than CPUs
        spin against each other on the pinned cores."""
        cpus = self.cpu_slots(name)
        if not cpus:
            return
        have, parts = len(cpus[0]), name.split("+")
        services = self.runfile.services
        asked: list[tuple[str, int, int, str]] = []  # (key, threads, CPUs it gets, who gets them)
        if "trainer" in parts:
            devices = services.trainer.devices  # a rank group shares its CPUs out among its ranks (trainer/nodes.py)
            per_rank = min(len(share) for share in split_evenly(cpus[0], devices.nproc_per_node))
            asked.append(("services.trainer.devices.num_threads", devices.num_threads, per_rank,
                          "each rank" if devices.nproc_per_node > 1 else "each instance"))
        engine = services.rollout.engine
        if "rollout" in parts and isinstance(engine, TorchEngineConfig):
            asked.append(("services.rollout.engine.num_threads", engine.num_threads, have, "each instance"))
        for key, threads, fits, who in asked:
            if threads > fits:
                raise ConfigError(f"config key {key} is {threads}, but placement.{name}.cpus gives {who} {fits} "
                                  f"CPU(s); set it to 0 (follow the placement) or at most {fits}")

    def _check_devices(self, name: str, count: int) -> None:
        """The trainer's ranks and the engine's device fit the ``count`` GPUs each instance sees."""
        services, parts = self.runfile.services, name.split("+")
        given = f"placement.{name}.gpus gives each instance {count} GPU(s)"
        if "trainer" in parts:
            devices = services.trainer.devices
            if devices.device.startswith("cuda"):
                if count == 0:
                    raise ConfigError(f"config key services.trainer.devices.device is {devices.device!r}, but {given}")
                index = int(devices.device.split(":")[1]) if ":" in devices.device else 0
                if index >= count:
                    raise ConfigError(f"config key services.trainer.devices.device is {devices.device!r}, but {given} "
                                      f"(cuda:0..cuda:{count - 1} inside the process)")
            if devices.device != "cpu" and count and devices.nproc_per_node > count:
                raise ConfigError(f"config key services.trainer.devices.world_size: {devices.nproc_per_node} rank(s) "
                                  f"on this node, one GPU each, but {given}")
        engine = services.rollout.engine
        if "rollout" in parts and isinstance(engine, TorchEngineConfig) and engine.device.startswith("cuda"):
            index = int(engine.device.split(":")[1]) if ":" in engine.device else 0
            if index >= count:
                raise ConfigError(f"config key services.rollout.engine.device is {engine.device!r}, but {given}"
                                  + (f" (cuda:0..cuda:{count - 1} inside the process)" if count else ""))
        if "rollout" in parts and isinstance(engine, VllmEngineConfig) and engine.tensor_parallel_size > count:
            raise ConfigError(f"config key services.rollout.engine.tensor_parallel_size is "
                              f"{engine.tensor_parallel_size}, but {given}")

    def _implied_gpus(self, name: str) -> list[list[int]] | None:
        """The GPUs an unplaced process would take from every GPU it sees, where that is certain: on a GPU
        host (the trainer on "cuda") a trainer's ranks take cuda:0.., a vLLM engine cuda:0.. of its tensor
        parallel size. None: not knowable from the file (a CPU host, "auto" devices)."""
        services, parts = self.runfile.services, name.split("+")
        devices, engine = services.trainer.devices, services.rollout.engine
        if not devices.device.startswith("cuda"):
            return None
        if "trainer" in parts:
            first = int(devices.device.split(":")[1]) if ":" in devices.device else 0
            return [list(range(first, first + devices.nproc_per_node))] * self.instances[name]
        if "rollout" in parts and isinstance(engine, VllmEngineConfig):
            return [list(range(engine.tensor_parallel_size))] * self.instances[name]
        return None

    def _check_overlap(self) -> None:
        held: dict[int, tuple[str, int, str]] = {}  # GPU -> (process, instance, what holds it)
        for name in self.instances:
            what, gpus = self._holds_whole_gpu(name), self.gpu_slots(name)
            if gpus is None:  # not placed: what it takes of every GPU it sees, where that is certain
                gpus = self._implied_gpus(name)
            if what is None or not gpus:
                continue
            for i, instance in enumerate(gpus[: self.instances[name]]):
                for gpu in instance:
                    if gpu in held and "vllm" in (what, held[gpu][2]):
                        other, j, other_what = held[gpu]
                        unset = [f"placement.{n}.gpus" for n in (other, name) if self.gpu_slots(n) is None]
                        raise ConfigError(
                            f"config keys placement.{other}.gpus and placement.{name}.gpus: GPU {gpu} is given to "
                            f"{other}-{j} ({other_what}) and {name}-{i} ({what})"
                            + (f" ({' and '.join(unset)} unset: every GPU visible, cuda:0 first)" if unset else "")
                            + "; vLLM takes most of a GPU's memory and does not start beside another process on it. "
                            'Give each its own GPUs, or colocate the trainer and rollout in one process ([launcher] '
                            'services = { "trainer+rollout" = 1 }) so they time-share it')
                    held[gpu] = (name, i, what)

    # --- what a process starts with ------------------------------------------------------------

    def for_instance(self, name: str, index: int, env: Mapping[str, str] | None = None,
                     host_cpus: set[int] | None = None) -> Placed:
        """Environment and CPUs of instance ``index`` of process ``name`` on this host (``env``: the
        launcher's environment, ``host_cpus`` the CPUs it may use; None: its own); raises ConfigError when
        this host cannot serve it."""
        env = os.environ if env is None else env
        entry = self.entries.get(name) or ServicePlacement()
        gpus = self.gpu_slots(name)
        visible: list[str] | None = None
        if self.cpu_only(name):
            visible = []
        elif gpus is not None:
            if index >= max(len(gpus), 1) and entry.gpus:
                raise ConfigError(f"config key placement.{name}.gpus: no GPUs left for instance {index} of {name} "
                                  f"({len(gpus)} slice(s))")
            mine = gpus[index] if gpus else []
            outer = env.get("CUDA_VISIBLE_DEVICES")
            if outer is not None:
                seen = [d.strip() for d in outer.split(",") if d.strip()]
                if any(g >= len(seen) for g in mine):
                    raise ConfigError(f"config key placement.{name}.gpus: {mine} are indices into the launcher's "
                                      f"CUDA_VISIBLE_DEVICES={outer!r}, which has {len(seen)}")
                visible = [seen[g] for g in mine]
            else:
                visible = [str(g) for g in mine]
        cpus = self.cpu_slots(name)
        if cpus and index >= len(cpus):
            raise ConfigError(f"config key placement.{name}.cpus: no CPUs left for instance {index} of {name} "
                              f"({len(cpus)} slice(s))")
        mine_cpus = cpus[index] if cpus else []
        allowed = os.sched_getaffinity(0) if host_cpus is None else host_cpus
        if set(mine_cpus) - allowed:
            raise ConfigError(f"config key placement.{name}.cpus: CPU(s) {sorted(set(mine_cpus) - allowed)} are not "
                              f"available to the launcher on this host (it may use {sorted(allowed)})")
        return Placed(env=process_env(visible, mine_cpus, entry.threads), cpus=mine_cpus)

    def check_host(self, env: Mapping[str, str] | None = None) -> Layout:
        """Every instance the launcher starts first can be placed on this host; returns this layout."""
        for name, count in self.runfile.launcher.services.items():
            for i in range(count):
                self.for_instance(name, i, env)
        return self

    def requests(self, name: str) -> tuple[int, int]:
        """GPUs and CPUs one instance of ``name`` asks for (0: not placed): what the deploy files request
        (``nvidia.com/gpu``, compose's device reservations, SkyPilot's accelerators)."""
        gpus, cpus = self.gpu_slots(name), self.cpu_slots(name)
        return (len(gpus[0]) if gpus else 0), (len(cpus[0]) if cpus else 0)
