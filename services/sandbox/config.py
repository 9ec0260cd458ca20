"""Configuration of the sandbox service (section ``[services.sandbox]``).

Only msgspec here: the config parses without the backend's dependencies, and a
test can parse every shipped config file.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

import msgspec

#: What base ``"host"`` exposes read-only: the host's system directories, not its whole
#: ``/`` (which would show the repository, /root, /home, the state directory...), nor its
#: /etc (sandboxes get a synthesized one, see ``etc.py``; list "/etc" to show the host's).
#: Missing entries are skipped; symlinks (merged /usr) are recreated as symlinks.
DEFAULT_HOST_PATHS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}

_INSTANCE_ID = re.compile(r"^[a-z0-9]{1,32}$")

#: host defaults of the admission bounds: live sandboxes per CPU core (and at most), creates at once per core
SANDBOXES_PER_CORE = 128
MAX_DEFAULT_SANDBOXES = 2048
CREATING_PER_CORE = 2
#: the default memory budget of an instance: this share of the host's memory
DEFAULT_BUDGET_SHARE = 0.5


def host_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def host_memory_mb() -> int:
    """The host's memory in MiB (``MemTotal``); 4096 when /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4096


class LimitsConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Concrete per-sandbox resource limits."""

    #: memory of the sandbox's processes (RSS + page cache + kernel memory) in MiB; its cgroup's limit is
    #: ``memory_mb + disk_mb`` (its files are bounded by ``disk_mb`` on their own)
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 512
    #: processes and threads alive at once
    pids: Annotated[int, msgspec.Meta(ge=4)] = 128
    #: CPU bandwidth in cores
    cpus: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    #: MiB of files the sandbox may write (work directory, /tmp, /dev/shm and its snapshots together); they live
    #: in a size-limited tmpfs charged to the sandbox's memory cgroup, whose limit adds ``disk_mb`` to ``memory_mb``
    #: (a full disk is ENOSPC, never an OOM kill)
    disk_mb: Annotated[int, msgspec.Meta(ge=1)] = 256
    #: files, directories and links the sandbox may create (the tmpfs's inode limit)
    inodes: Annotated[int, msgspec.Meta(ge=64)] = 32768


class SandboxConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[services.sandbox]`` section."""

    #: isolation backend: ``bwrap`` (bubblewrap + cgroups + overlayfs; needs root) or
    #: ``unsafe-process`` (plain processes, NO isolation: development only, warns loudly)
    type: Literal["bwrap", "unsafe-process"] = "bwrap"
    #: state directory: per-instance work layers, snapshots, locks. Every path component
    #: must be searchable by ``sandbox_uid`` (the bwrap backend checks at start)
    root_dir: str = "/var/lib/rlbus/sandbox"
    #: this instance's id ([a-z0-9]{1,32}); None = random. A restarted instance with the same
    #: id reaps what its predecessor left, like any other orphan
    instance_id: str | None = None
    #: named read-only base roots a create may ask for (``base = "<name>"``): name -> directory
    #: holding a root filesystem (e.g. an unpacked container image)
    images: dict[str, str] = {}
    #: directories of the host exposed read-only by base ``"host"``; without "/etc" here, sandboxes see a
    #: synthesized /etc (users, hosts, resolver, CA certificates; see ``etc.py``), not the host's
    host_paths: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_HOST_PATHS))
    #: base ``"host"`` also shows the site-packages of the Python environment this service runs in (read-only,
    #: at /.rlbus-python/N) and every exec gets them on ``PYTHONPATH``: sandboxed agent commands import the
    #: packages installed beside rlbus (mini-swe-agent, litellm, openai) with the sandbox's ``python3``, which
    #: must be the same minor version as the service's Python (checked at start)
    python_packages: bool = False
    #: the writable work directory inside the sandbox (overlay layers; snapshotted and forked)
    workdir: str = "/workspace"
    #: host uid/gid sandboxed processes run as (unprivileged); root inside the sandbox maps to it
    sandbox_uid: Annotated[int, msgspec.Meta(ge=1)] = 65534
    sandbox_gid: Annotated[int, msgspec.Meta(ge=1)] = 65534
    #: hostname inside sandboxes
    hostname: str = "sandbox"
    #: base environment of every exec (the service's own environment never leaks in);
    #: HOME is the work directory
    env: dict[str, str] = msgspec.field(default_factory=lambda: dict(DEFAULT_ENV))
    #: limits a create gets when it names none
    default_limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    #: the most a create may ask for
    max_limits: LimitsConfig = msgspec.field(
        default_factory=lambda: LimitsConfig(memory_mb=16384, pids=4096, cpus=8.0, disk_mb=16384, inodes=1_000_000)
    )
    #: wall-time limit of a foreground exec that names none, and the most one may ask for
    default_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0
    max_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 3600.0
    #: cap on each of stdout/stderr of an exec that names none, and the most one may ask for
    default_max_output_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1 << 20
    max_output_bytes: Annotated[int, msgspec.Meta(ge=0)] = 16 << 20
    #: bytes read_files returns per file by default
    default_read_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1 << 20
    #: lease of a sandbox that names none, and the longest one may ask for (seconds)
    default_lease_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    max_lease_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] = 86400.0
    #: sandboxes this instance holds at once, creates in progress and queued included (creates beyond are
    #: refused ``overloaded``); None = 128 per CPU core, at most 2048 (every exec's mount namespace copies
    #: the host's mounts, two per sandbox: exec latency grows with this number)
    max_sandboxes: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: creates carried out at once (None = 2 per CPU core, at least 4); more wait in a queue
    max_creating: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: creates waiting for a slot (None = 8 x max_creating); a create beyond is refused ``overloaded`` at once
    max_queued_creates: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: requests carried out at once (execs included); a request beyond is refused ``overloaded`` at once
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 2048
    #: deadline of a request that carries none (header ``Rlbus-Deadline``), from its arrival; a request past its
    #: deadline is never started
    request_deadline_s: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0
    #: ``retry_after_s`` of an ``overloaded`` answer (the sender waits at least this long before trying again)
    overload_retry_after_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5
    #: MiB of memory all sandboxes of this instance may use together: their processes, files and the files of
    #: destroyed sandboxes still used by forks (the instance's cgroup, limited to this by the kernel). A create
    #: is refused ``overloaded`` when the instance's working set plus the new sandbox's ``memory_mb + disk_mb``
    #: exceeds it; None = half the host's memory
    memory_budget_mb: Annotated[int, msgspec.Meta(ge=64)] | None = None
    #: read-only layers under a sandbox's writable layer (one per snapshot that changed
    #: something); a snapshot beyond is refused with ``limit``
    max_layers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 48
    #: TCP port of the egress proxy inside sandboxes with an allowlist (127.0.0.1:<port>)
    egress_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 3128
    #: seconds the egress proxy waits to connect to an allowed host
    egress_connect_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    #: ``host:port`` targets on loopback, link-local or the bus's addresses that an allowlist may name after all
    #: (e.g. ["127.0.0.1:8080"] for a package mirror on the host); every other such target is refused whatever
    #: a create's allowlist says
    egress_open_internal: list[str] = []
    #: the bubblewrap and setpriv executables (names are looked up on PATH)
    bwrap_path: str = "bwrap"
    setpriv_path: str = "setpriv"
    #: how an exec starts. ``bwrap``: each exec is its own bubblewrap (sh, setpriv, bwrap: ~9 ms here).
    #: ``server``: through the sandbox's exec server (its pid 1, started by bubblewrap once, at the first exec,
    #: which waits for it; then an exec is a request on a socket, see ``exec_server.py``). ``hybrid``: the second
    #: exec starts the server in the background and execs run through their own bwrap until it is ready (a
    #: sandbox that runs one exec costs what it costs with ``bwrap``, later execs what they cost with ``server``). A base
    #: without ``exec_server_python`` runs every exec through its own bwrap
    exec_path: Literal["bwrap", "server", "hybrid"] = "hybrid"
    #: the interpreter that runs the exec server, a path inside the sandbox's base; a base without it runs every
    #: exec through its own bwrap
    exec_server_python: str = "/usr/bin/python3"
    #: sandboxes of the default spec (base ``host``, ``default_limits``, no egress) kept created, their exec server
    #: started, ahead of the creates that will take them (bwrap backend; 0: none). A create asking for exactly that
    #: spec (its env, labels, lease and files are applied as it takes one) gets one at once, with every exec going
    #: through its server from the first; the pool refills in the background, one sandbox at a time, paused while
    #: creates queue or the instance is near a bound (it keeps one sandbox of ``max_sandboxes`` free). Pooled
    #: sandboxes count against ``max_sandboxes`` and the memory budget; each costs its server's start (~20-60 ms of
    #: CPU) and memory (~10 MiB) even if never taken
    warm_pool: Annotated[int, msgspec.Meta(ge=0, le=256)] = 2
    #: cgroup directory (below each hierarchy's root) that holds ``<instance>/<sandbox>``
    cgroup_parent: str = "rlbus"

    def __post_init__(self) -> None:
        if self.instance_id is not None and not _INSTANCE_ID.match(self.instance_id):
            raise ValueError(f"instance_id {self.instance_id!r} must match [a-z0-9]{{1,32}}")
        if not self.workdir.startswith("/") or self.workdir in ("/", "/tmp") or ".." in self.workdir:
            raise ValueError(f"workdir {self.workdir!r} must be an absolute path other than / and /tmp")
        if not self.exec_server_python.startswith("/"):
            raise ValueError(f"exec_server_python {self.exec_server_python!r} must be an absolute path")
        if not self.root_dir.startswith("/"):
            raise ValueError(f"root_dir {self.root_dir!r} must be an absolute path")
        for entry in self.egress_open_internal:
            host, sep, port = entry.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"egress_open_internal entry {entry!r} is not host:port (e.g. 127.0.0.1:8080)")
        if "host" in self.images:
            raise ValueError('images may not be named "host" (that name is the host base)')
        for name, field in (("default_limits", self.default_limits),):
            m = self.max_limits
            if (field.memory_mb > m.memory_mb or field.pids > m.pids or field.cpus > m.cpus
                    or field.disk_mb > m.disk_mb or field.inodes > m.inodes):
                raise ValueError(f"{name} exceeds max_limits")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s exceeds max_timeout_s")
        if self.default_max_output_bytes > self.max_output_bytes:
            raise ValueError("default_max_output_bytes exceeds max_output_bytes")
        if self.default_lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError("default_lease_ttl_s exceeds max_lease_ttl_s")

    # --- the admission bounds, host defaults filled in (see admission.py) ---------------------------

    def sandboxes_bound(self) -> int:
        return self.max_sandboxes or min(MAX_DEFAULT_SANDBOXES, SANDBOXES_PER_CORE * host_cores())

    def creating_bound(self) -> int:
        return self.max_creating or max(4, CREATING_PER_CORE * host_cores())

    def queued_creates_bound(self) -> int:
        return self.max_queued_creates if self.max_queued_creates is not None else 8 * self.creating_bound()

    def memory_budget(self) -> int:
        """The instance's memory budget in MiB."""
        return self.memory_budget_mb or int(host_memory_mb() * DEFAULT_BUDGET_SHARE)
