"""How CLI commands reach a run's bus: the live server the run used, or, for a finished or stopped run, its
stored JetStream started on a free local port for the command (``tap``, ``status``, ``replay``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from services.runtime.config import ConfigError, RunSection, convert, load_tree

T = TypeVar("T")


def add_bus_args(p: argparse.ArgumentParser) -> None:
    """The options of every command that reads a run's bus (what :func:`bus_sections` and
    :func:`with_connection` read back)."""
    p.add_argument("--config", "-c", metavar="FILE", help="run file (TOML); its [run] and [nats] sections are used")
    p.add_argument("--nats-url", metavar="URL", help="NATS server URL (overrides [nats] url)")
    p.add_argument("--run-id", metavar="ID", help="run id (overrides [run] id)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set services.rollout.concurrency=64 (repeatable)")
    p.add_argument("--run-dir", metavar="DIR", help="read a finished or stopped run from its directory: its stored "
                   "JetStream is started on a free port and read (default: the live server; when none answers, "
                   "the run directory of --config is read this way)")


def overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` values plus ``--nats-url`` and ``--run-id`` as config overrides."""
    o = list(args.overrides)
    if getattr(args, "nats_url", None):
        o.append(f'nats.url="{args.nats_url}"')
    if getattr(args, "run_id", None):
        o.append(f'run.id="{args.run_id}"')
    return o


def bus_sections(args: argparse.Namespace) -> tuple[RunSection, Any]:
    """The run's ``[run]`` and ``[nats]`` sections from ``--config``, ``--set``, ``--nats-url`` and ``--run-id``."""
    from services.runtime.config import NatsSection

    tree = load_tree(args.config, None, overrides(args))
    return convert(tree.get("run"), RunSection, "run"), convert(tree.get("nats"), NatsSection, "nats")


async def with_connection(args: argparse.Namespace, fn: Callable[[Any, str], Awaitable[T]]) -> T:
    """``await fn(nc, run_id)`` on the run's server: the URL the run actually used (its run directory), its
    read-only admin login; when no server answers (a finished or stopped run) or with ``--run-dir``, on the
    run's stored JetStream."""
    from services.runtime import bus

    run, nats_cfg = bus_sections(args)
    run_dir = Path(getattr(args, "run_dir", None) or run.dir)
    if getattr(args, "run_dir", None):
        return await with_stored_streams(run_dir, run.id, fn)
    resolved = run_dir / "config.resolved.json"
    if not getattr(args, "nats_url", None) and resolved.is_file():
        try:  # the URL the run's launcher actually used (rlbus up picks another port when its own is taken)
            nats_cfg.url = json.loads(resolved.read_text())["nats"]["url"]
        except (ValueError, KeyError, TypeError):
            pass
    nats_cfg.max_reconnect_attempts = 3
    if nats_cfg.user is None and nats_cfg.creds_file is None:
        from services.launcher.auth import AuthError, load_auth

        try:  # a run started by `rlbus up` / `rlbus run`: read-only admin login from its run directory
            admin = load_auth(run.dir).for_role("admin")
            nats_cfg.user, nats_cfg.password = admin.user, admin.password
        except AuthError:
            pass  # an open server, or credentials given some other way
    try:
        nc = await bus.connect(nats_cfg, "rlbus-cli", first_attempts=1)
    except bus.BusError:
        if not (run_dir / "nats").is_dir():
            raise
        print(f"[rlbus] no NATS server at {nats_cfg.url}; reading the streams stored in {run_dir} "
              "(a finished or stopped run)", file=sys.stderr)
        return await with_stored_streams(run_dir, run.id, fn)
    try:
        return await fn(nc, run.id)
    finally:
        await nc.close()


async def with_stored_streams(run_dir: Path, run_id: str, fn: Callable[[Any, str], Awaitable[T]]) -> T:
    """Run ``fn(nc, run_id)`` against the run's stored JetStream, started on a free local port for the call."""
    import nats

    from services.runtime.natsd import EmbeddedNats

    if not (run_dir / "nats").is_dir():
        raise ConfigError(f"{run_dir / 'nats'} does not exist: not the directory of a run started by rlbus run/up")
    with EmbeddedNats(run_dir / "nats", port=None) as server:
        nc = await nats.connect(server.url, allow_reconnect=False)
        try:
            return await fn(nc, run_id)
        finally:
            await nc.close()
