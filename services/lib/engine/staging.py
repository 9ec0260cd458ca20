"""Weight updates staged for vLLM's workers: one safetensors file per update in ``staging_dir``.

The vLLM engine hands a new version to its worker processes as a file they read (same host). The default
place is ``/dev/shm`` (memory, no disk write), but containers get a small one: 64 MiB in Docker and in a
Kubernetes pod unless the deployment says otherwise (``deploy/compose`` sets ``shm_size``, ``deploy/k8s``
mounts a memory ``emptyDir`` of a stated size at ``/dev/shm``). So before a byte is written the free space is
checked, and a write that fails anyway (a full disk, a file size limit) leaves no partial file behind: either
way the update fails with :class:`StagingError` naming the directory, the bytes needed and the bytes free,
and the engine keeps the version it has. No vLLM import here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

from services.lib.engine.base import WeightUpdateError

#: bytes of safetensors header per tensor beyond its name (dtype, shape, offsets as JSON), rounded up
HEADER_BYTES_PER_TENSOR = 128
#: where the engine stages when ``staging_dir`` is empty and /dev/shm is not writable
FALLBACK = tempfile.gettempdir()


class StagingError(WeightUpdateError):
    """A weight update could not be staged (no room, no such directory, a failed write); nothing was left
    behind and the engine kept its weights."""


def staging_base(configured: str) -> str:
    """The directory updates are staged in: ``configured``, else /dev/shm when writable, else the temp dir."""
    if configured:
        return configured
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else FALLBACK


def needed_bytes(tensors: Mapping[str, Any]) -> int:
    """Bytes of the safetensors file holding ``tensors`` (data, plus a bound on the header)."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    header = 8 + sum(len(name.encode()) + HEADER_BYTES_PER_TENSOR for name in tensors)
    return data + header


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer can still put in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def stage(tensors: Mapping[str, Any], directory: str, prefix: str) -> str:
    """Write ``tensors`` (CPU, contiguous, no shared storage) as a new safetensors file in ``directory`` and
    return its path; the caller removes it once the workers have read it.

    Raises :class:`StagingError` when ``directory`` is missing or too small for the update, or the write
    fails; no file is left behind then."""
    from safetensors.torch import save_file

    hint = ("set [services.rollout] engine.staging_dir to a larger directory on this host, or give the "
            "container a larger /dev/shm (docker: shm_size; Kubernetes: an emptyDir with medium Memory)")
    if not os.path.isdir(directory):
        raise StagingError(f"staging dir {directory} does not exist (engine.staging_dir); create it or {hint}")
    need, free = needed_bytes(tensors), free_bytes(directory)
    if need > free:
        raise StagingError(f"staging dir {directory} has {_mib(free)} free ({free} bytes) but the weight update "
                           f"needs {_mib(need)} ({need} bytes): {hint}")
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file(dict(tensors), path)
    except BaseException as exc:
        os.unlink(path)  # never leave a partial update behind (it would fill the directory up further)
        if not isinstance(exc, Exception):
            raise
        raise StagingError(f"staging the weight update in {directory} failed ({type(exc).__name__}: {exc}); "
                           f"needed {_mib(need)}, {_mib(free_bytes(directory))} free now: {hint}") from exc
    return path


def stage_state_dict(state_dict: Mapping[str, Any], directory: str, version: int, *, tied: bool,
                     embed: str) -> str:
    """Write the tensors (CPU, contiguous, tied ones de-duplicated) to a safetensors file vLLM's workers read,
    through :func:`stage`. ``tied``: the model ties its head to the embeddings (``embed``: the embeddings'
    name, or empty), which vLLM loads through the embeddings only."""
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in state_dict.items():
        if tied and name == "lm_head.weight":
            if embed in state_dict or not embed:
                continue
            name = embed
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return stage(tensors, staging_base(directory), f"rlbus-weights-v{version}-")
