"""Where a process runs: its GPUs and CPUs, as the environment and CPU affinity it starts with.

``[placement.<service>]`` in the run file (one entry per service of ``[launcher] services``, a colocated
``"trainer+rollout"`` included) lists the GPUs and CPUs of the host that the service's instances share
out: instance ``i`` takes the ``i``-th slice. A process learns its share from what it starts with:

* ``CUDA_VISIBLE_DEVICES``: its GPUs (``""``: none; CPU-only services always get ``""``, placed or not);
* CPU affinity (``os.sched_setaffinity`` before ``exec``), and ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
  matching the CPU count (torch sizes its intra-op pool from ``OMP_NUM_THREADS``);
* ``RLBUS_PLACEMENT_CPUS``: the CPU list again, so a trainer rank group can give each rank its own part.

This module is pure (no torch, no bus): the launcher (``services/launcher/placement.py``) checks a layout
and starts processes with it; the trainer's rank group splits its CPUs among its ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

from services.runtime.config import ConfigError

#: the variable that carries a process's CPU list to the process (for its own children: trainer ranks)
CPUS_ENV = "RLBUS_PLACEMENT_CPUS"
#: thread-count variables set to the CPU count of a placed process
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class ServicePlacement(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[placement.<service>]``: the GPUs and CPUs one service's instances share out (instance i takes
    the i-th slice of each list)."""

    #: GPU indices as the launcher sees them (into its own CUDA_VISIBLE_DEVICES when that is set, else the
    #: host's numbering), e.g. [0, 1, 2, 3]; unset: CPU-only services get none, others every GPU; []: none
    gpus: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    #: GPUs each instance takes (0: the list divided evenly among [launcher] services' count); more
    #: slots than instances leave room for `rlbus scale` / the autoscaler
    gpus_per_instance: NonNeg = 0
    #: CPU ids for CPU affinity: a list ([0, 1, 2]) or a Linux CPU list ("0-7,16-23"); empty: not pinned
    cpus: list[Annotated[int, msgspec.Meta(ge=0)]] | str = []
    #: CPUs each instance takes (0: the list divided evenly among the instances)
    cpus_per_instance: NonNeg = 0
    #: OMP_NUM_THREADS / MKL_NUM_THREADS of each instance (0: its CPU count when cpus is set, else unset)
    threads: NonNeg = 0

    def cpu_list(self, key: str) -> list[int]:
        """The CPUs as a list of ids (a CPU-list string parsed); ``key`` names the entry in errors."""
        return parse_cpus(self.cpus, f"{key}.cpus")


def parse_cpus(value: Sequence[int] | str, key: str) -> list[int]:
    """``[0, 2]`` or ``"0-3,8"`` as a list of distinct CPU ids, in order; a malformed list names ``key``."""
    if isinstance(value, str):
        ids: list[int] = []
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise ConfigError(f"config key {key}: {value!r} is not a CPU list (e.g. \"0-7,16-23\" or [0, 1])")
            first, last = int(lo), int(hi) if dash else int(lo)
            if last < first:
                raise ConfigError(f"config key {key}: range {part!r} runs backwards")
            ids += range(first, last + 1)
    else:
        ids = list(value)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"config key {key}: CPU {next(i for i in ids if ids.count(i) > 1)} is listed twice")
    return ids


def format_cpus(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form ``/proc/<pid>/status`` and ``taskset`` use)."""
    out: list[str] = []
    ordered = sorted(ids)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def slots(items: Sequence[int], per: int, instances: int, key: str) -> list[list[int]]:
    """``items`` cut into slices of ``per`` (0: evenly among ``instances``); errors name ``key``."""
    if not items:
        return []
    if per == 0:
        if instances < 1 or len(items) % instances:
            raise ConfigError(f"config key {key}: {len(items)} cannot be shared evenly among {instances} "
                              f"instance(s); list a multiple of {max(instances, 1)} or set {key}_per_instance")
        per = len(items) // instances
    if len(items) % per:
        raise ConfigError(f"config key {key}: {len(items)} is not a multiple of {key}_per_instance = {per}")
    cut = [list(items[i:i + per]) for i in range(0, len(items), per)]
    if len(cut) < instances:
        raise ConfigError(f"config key {key}: {len(cut)} slice(s) of {per} for {instances} instances; list more "
                          f"or lower {key}_per_instance")
    return cut


def split_evenly(cpus: Sequence[int], parts: int) -> list[list[int]]:
    """``cpus`` in ``parts`` contiguous shares (the first ones one longer when it does not divide; a
    share is never empty: with fewer CPUs than parts, shares wrap around)."""
    if not cpus:
        return [[] for _ in range(parts)]
    if len(cpus) < parts:
        return [[cpus[i % len(cpus)]] for i in range(parts)]
    base, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(cpus[start:start + size]))
        start += size
    return out


def process_env(gpus: Sequence[str] | None, cpus: Sequence[int], threads: int) -> dict[str, str]:
    """The variables a placed process starts with: ``gpus`` None leaves CUDA_VISIBLE_DEVICES as
    inherited; thread counts from ``threads`` (0: the CPU count, when there are CPUs)."""
    env: dict[str, str] = {}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    count = threads or len(cpus)
    if count:
        env.update({name: str(count) for name in THREAD_ENV})
    if cpus:
        env[CPUS_ENV] = format_cpus(cpus)
    return env


def inherited_cpus(env: Mapping[str, str] | None = None) -> list[int]:
    """The CPU list this process was placed on (``RLBUS_PLACEMENT_CPUS``), or [] when it was not."""
    value = (os.environ if env is None else env).get(CPUS_ENV, "")
    return parse_cpus(value, CPUS_ENV) if value else []
