"""Shared fixtures and helpers: a real nats-server with JetStream on a free port, ``wait_for``
(poll an observable condition with a deadline) and ``run_file`` (the loop tests' run config)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.runtime.natsd import EmbeddedNats, free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def nats_server(tmp_path):
    """A fresh nats-server (JetStream, file storage under tmp_path) for one test."""
    server = EmbeddedNats(tmp_path / "nats", port=None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, unmounted afterwards (mounting needs root, as on these machines)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def loop_model_dir(tmp_path_factory):
    """The default example's tiny model with a short warm-up (built once per test session)."""
    from services.tasks.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("loop-model-cache"), seed=0, warmup_steps=60)


# ---- waiting on an observable condition (never a bare sleep) ----


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate()`` until it returns a truthy value (returned) or ``timeout`` seconds pass
    (AssertionError naming ``what`` and the last value seen)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last value: {value!r})")
        time.sleep(interval)


async def wait_for_async(predicate: Callable[[], Any], timeout: float, what: str,
                         interval: float = 0.05) -> Any:
    """``wait_for`` in an event loop; ``predicate`` may be a plain or an async function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last value: {value!r})")
        await asyncio.sleep(interval)


# ---- run files for the loop and chaos tests ----


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a TOML basic string
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_table(name: str, values: dict[str, Any]) -> str:
    return f"[{name}]\n" + "".join(f"{_toml_key(k)} = {_toml_value(v)}\n" for k, v in values.items())


def trainer_records(metrics: Path) -> list[dict[str, Any]]:
    """The trainer's step records in a run's ``metrics.jsonl`` so far (a line still being written is skipped)."""
    out = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "trainer/version" in rec:
                out.append(rec)
    return out


def last_step(metrics: Path) -> int:
    """The newest trainer step recorded in ``metrics.jsonl`` (0 before the first)."""
    return max((r["step"] for r in trainer_records(metrics)), default=0)


def run_file(tmp_path: Path, model: Path | str, *, run_id: str, trainer: dict[str, Any],
             rollout: dict[str, Any] | None = None, services: dict[str, int] | None = None,
             nats_url: str | None = None, launcher: dict[str, Any] | None = None,
             common: dict[str, Any] | None = None, task: str | None = None,
             task_options: dict[str, Any] | None = None, weights: dict[str, Any] | None = None,
             model_keys: dict[str, Any] | None = None, extra: str = "") -> Path:
    """Write ``tmp_path/run.toml`` for a tiny-model run in ``tmp_path/run`` and return its path.

    ``model`` is the run's ``[model] name`` (``model_keys``: its other keys, e.g. dtype); ``task``/``task_options``
    its ``[task]``; ``weights`` its
    ``[weights]`` (the transport). ``services`` (the launcher's layout, with a free NATS port) is for
    ``rlbus run`` and the supervisor; ``nats_url`` for a service run by the test against the ``nats_url``
    fixture. ``trainer`` and ``rollout`` override the shared defaults below (``rollout=None``: no rollout
    section); ``launcher``/``common`` add keys to those sections; ``extra`` is TOML appended as is.
    """
    parts = [_toml_table("run", {"id": run_id, "dir": tmp_path / "run"}),
             _toml_table("model", {"name": model, **(model_keys or {})})]
    if task is not None or task_options:
        parts.append(_toml_table("task", {**({"name": task} if task else {}),
                                          **({"options": task_options} if task_options else {})}))
    if weights is not None:
        parts.append(_toml_table("weights", weights))
    if nats_url is not None:
        parts.append(_toml_table("nats", {"url": nats_url}))
    if services is not None:
        launcher_keys = {"services": services, "nats_port": free_port(), **(launcher or {})}
        parts.append(_toml_table("launcher", launcher_keys))
    if common:
        parts.append(_toml_table("common", common))
    trainer_keys: dict[str, Any] = {"group_size": 4, "checkpoint_every": 0, "sampling": {"max_new_tokens": 6},
                                    "eval": {"every": 0}, "devices": {"num_threads": 1}}
    for key, value in trainer.items():  # a group's keys (sampling = {...}) are added to its defaults
        shared = isinstance(value, dict) and isinstance(trainer_keys.get(key), dict)
        trainer_keys[key] = {**trainer_keys[key], **value} if shared else value
    parts.append(_toml_table("services.trainer", trainer_keys))
    if rollout is not None:
        parts.append(_toml_table("services.rollout", {"engine": {"type": "torch", "num_threads": 1}, **rollout}))
    if extra:
        parts.append(extra.strip() + "\n")
    path = tmp_path / "run.toml"
    path.write_text("\n".join(parts))
    return path


@pytest.fixture
def nats_cluster(tmp_path):
    """A local 3-node JetStream cluster (three nats-server processes routed on 127.0.0.1, store dirs
    under tmp_path); ``nats_cluster.url`` lists every node, comma separated."""
    from services.runtime.natsd import NatsCluster

    cluster = NatsCluster(tmp_path / "nats-cluster", size=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


# ---- what a finished run left on record ----


class Recorded:
    """A finished run's stored JetStream, read back: trajectories, outcomes, the trainer consumer's state
    (``None`` when it has none) and the names of the streams it holds."""

    def __init__(self, trajectories: list, outcomes: list, trainer_consumer: Any, streams: list[str]) -> None:
        self.trajectories, self.outcomes = trajectories, outcomes
        self.trainer_consumer, self.streams = trainer_consumer, streams


def recorded(run_dir: Path, run_id: str) -> Recorded:
    """Start the run's stored JetStream on a free port and read what the run recorded (see :class:`Recorded`)."""
    import nats

    from proto import catalog
    from services.launcher.accounting import read_channel

    async def read() -> Recorded:
        with EmbeddedNats(Path(run_dir) / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                trajectories = await read_channel(js, catalog.TRAJECTORIES, run_id)
                outcomes = await read_channel(js, catalog.OUTCOMES, run_id)
                try:
                    consumer = await js.consumer_info("TRAJECTORIES", f"trainer-{run_id}")
                except Exception:  # nats' NotFoundError: the run never started a trainer consumer
                    consumer = None
                streams = [s.config.name for s in await js.streams_info()]
                return Recorded(trajectories, outcomes, consumer, streams)
            finally:
                await nc.close()

    return asyncio.run(read())
