"""``rlbus run`` (the main job: a run end to end with a progress display) and ``rlbus up`` (start a run's
services and supervise them), and how a target names a run file."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from services.runtime.config import ConfigError

DEFAULT_EXAMPLE = "addition"  # the main job: README, `./rlbus run`
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def resolve_target(target: str) -> str:
    """An example name (examples/NAME.toml) or a path to a run file."""
    p = Path(target)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"run file {target} does not exist")
        return str(p)
    candidate = EXAMPLES_DIR / f"{target}.toml"
    if candidate.is_file():
        return str(candidate)
    known = sorted(f.stem for f in EXAMPLES_DIR.glob("*.toml"))
    raise ConfigError(f"{target!r} is neither a run file nor an example; examples: {', '.join(known)}")


def add_parsers(sub: Any) -> None:
    up = sub.add_parser("up", help="start an embedded nats-server and every configured service locally",
                        description="Start an embedded nats-server with JetStream (data under the run directory; "
                        "a free port if the preferred one is taken), then each service listed in [launcher] "
                        "services as its own child process, restarting crashed ones with backoff. Ctrl-C stops "
                        "everything cleanly (services drain, then NATS stops) and leaves no process behind. "
                        "Logs: <run dir>/logs/<service>-<i>.log.")
    up.add_argument("config", nargs="?", metavar="CONFIG", help=f"run file (TOML) or example name; default: {DEFAULT_EXAMPLE}")
    up.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable)")
    up.add_argument("--for", dest="duration", type=float, metavar="SECONDS",
                    help="stop by itself after this many seconds (demos, CI)")
    up.add_argument("--nats-cluster", type=int, metavar="N", help="run the embedded NATS as a local JetStream "
                    "cluster of N nodes (3 or 5; routes on 127.0.0.1); streams and buckets get N replicas unless "
                    "[nats] replicas says otherwise (same as --set launcher.nats_cluster=N)")

    run = sub.add_parser("run", help="run an example or run file end to end (the main job)",
                         description="Run an RL job: an embedded nats-server and every service of the run as its "
                         "own process, with a live progress display; the run directory gets the resolved config, "
                         "metrics.jsonl, a reward curve, checkpoints and the final model. EXAMPLE_OR_CONFIG is a "
                         "name from examples/ (without .toml) or a path to a run file. Ctrl-C stops cleanly.")
    run.add_argument("target", nargs="?", default=DEFAULT_EXAMPLE, metavar="EXAMPLE_OR_CONFIG",
                     help=f"example name or run file (default: {DEFAULT_EXAMPLE})")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (repeatable)")
    run.add_argument("--for", dest="duration", type=float, metavar="SECONDS", help="stop after this many seconds")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--fresh", action="store_const", dest="mode", const="fresh", default="auto",
                       help="start over: an earlier run in the run directory is moved aside to <dir>.N first")
    again.add_argument("--resume", action="store_const", dest="mode", const="resume",
                       help="extend a finished run (with services.trainer.total_steps above the step it finished "
                       "at); a stopped or crashed run is resumed without it")


def cmd_up(args: argparse.Namespace) -> int:
    import threading

    from services.launcher.supervisor import Supervisor

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    overrides = list(args.overrides)
    if args.nats_cluster is not None:
        overrides.append(f"launcher.nats_cluster={args.nats_cluster}")
    sup = Supervisor(resolve_target(args.config or DEFAULT_EXAMPLE), overrides, quiet=False)
    sup.install_signal_handlers()
    timer: threading.Timer | None = None
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        _write_nats_context(sup)
        if args.duration:
            timer = threading.Timer(args.duration, sup.stopping.set)
            timer.start()
        sup.wait()
    finally:
        if timer:
            timer.cancel()
        sup.stop()
    return 0


def _write_nats_context(sup) -> None:
    """``<run dir>/nats-context.json``: a context of the ``nats`` CLI for the run's admin login (read-only on
    the run's streams), so stock tools can look at the bus; says how to use it."""
    url = sup.nats_url
    context = {"description": f"rlbus run {sup.run.id} ({sup.run_dir})", "url": url}
    if sup.auth is not None:
        admin = sup.auth.for_role("admin")
        context.update(user=admin.user, password=admin.password)
    path = sup.run_dir / "nats-context.json"
    path.write_text(json.dumps(context, indent=2) + "\n")
    path.chmod(0o600)
    print(f"[rlbus] nats CLI: cp {path} ~/.config/nats/context/rlbus-{sup.run.id}.json && nats --context "
          f"rlbus-{sup.run.id} stream ls   (or: rlbus tap/status --config ...)", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from services.launcher.progress import follow, plot_rewards
    from services.launcher.runstate import RunDirError, prepare
    from services.launcher.supervisor import Supervisor

    sup = Supervisor(resolve_target(args.target), args.overrides, quiet=False)
    total = sup.runfile.services.trainer.total_steps
    try:
        said = prepare(sup.run_dir, sup.run.id, args.mode, total)
        print(f"[rlbus] {said}", file=sys.stderr)
    except RunDirError as e:
        print(f"[rlbus] {e}", file=sys.stderr)
        return 2
    final: dict = {}
    trainer_down: list[str] = []  # why the run was stopped because its trainer cannot go on
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()

        async def main() -> dict:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            if args.duration:
                loop.call_later(args.duration, stop.set)

            async def watch_children() -> None:
                while not stop.is_set():
                    bad = sorted({e["child"] for e in sup.events if e.get("event") == "config_error"})
                    if bad:  # the run file must change: the rest of the run would only wait for it
                        print(f"[rlbus] {', '.join(bad)} stopped on a configuration error; stopping the run",
                              file=sys.stderr)
                        stop.set()
                        break
                    if any(c.given_up and "trainer" in c.service.split("+") and c.proc is None for c in sup.children) and \
                            not (sup.run_dir / "summary.json").exists():
                        print("[rlbus] the trainer is down for good; stopping the run", file=sys.stderr)
                        trainer_down.append("the trainer is down for good (it crashed repeatedly; see its log above)")
                        stop.set()
                    await asyncio.sleep(1.0)  # supervision check period

            watcher = asyncio.create_task(watch_children(), name="run-watch-children")
            try:
                url = sup.nats_url
                if sup.auth is not None:
                    url = ",".join(sup.auth.for_role("launcher").url(u) for u in url.split(","))
                return await follow(url, sup.run.id, total, stop, extending=said.startswith("extending"))
            finally:
                watcher.cancel()

        final = asyncio.run(main())
    finally:
        sup.stop()
    png = plot_rewards(sup.run_dir / "metrics.jsonl", sup.run_dir / "reward_curve.png")
    if final.get("state") == "finished":
        first, last = final.get("first_eval"), final.get("last_eval")
        gain = "" if first is None or last is None else f"; eval reward {100 * first:.1f}% -> {100 * last:.1f}%"
        print(f"[rlbus] run finished at step {final.get('step')}{gain}", file=sys.stderr)
        print(f"[rlbus] final model: {final.get('final_model')}", file=sys.stderr)
    if png:
        print(f"[rlbus] reward curve: {png}; metrics: {sup.run_dir / 'metrics.jsonl'}", file=sys.stderr)
    if sup.gang_failed:
        print("[rlbus] run failed: its gang was not admitted (see the service logs for the missing roles)",
              file=sys.stderr)
        return 1
    bad = sorted({e["child"] for e in sup.events if e.get("event") == "config_error"})
    if bad:
        print(f"[rlbus] run failed: {', '.join(bad)} stopped on a configuration error (above)", file=sys.stderr)
        return 1
    if trainer_down and final.get("state") != "finished":
        print(f"[rlbus] run failed: {trainer_down[0]}", file=sys.stderr)
        return 1
    return 0 if final.get("state") in ("finished", None) else 1


