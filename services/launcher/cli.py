"""The ``rlbus`` command line. Parses arguments first; heavy modules load only where needed."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence

from services.launcher import config_cmd, doctor, replay_cmd, run_cmd, simulate_cmd
from services.launcher.connect import add_bus_args, bus_sections, overrides, with_connection
from services.launcher.run_cmd import DEFAULT_EXAMPLE, resolve_target  # noqa: F401  (re-exported: tests, config_cmd)
from services.launcher.runfile import BUILTIN_SERVICES, RunFile
from services.runtime.config import ConfigError, RunSection, convert, load_service_config, load_tree
from services.runtime.service import CONFIG_ERROR_EXIT

DESCRIPTION = """\
rlbus: reinforcement-learning post-training of language models as independent
services on NATS JetStream. Every command reads the same run file (TOML);
values can be overridden by RLBUS__SECTION__KEY environment variables and by
--set section.key=value flags, in that order."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbus", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run_cmd.add_parsers(sub)

    svc = sub.add_parser("service", help="run one service against any NATS server (what containers run)",
                         description="Run one service in the foreground against the NATS server of the run file "
                         "(or --nats-url). SIGTERM/SIGINT stop it gracefully: it stops fetching, finishes "
                         "in-flight work within common.drain_timeout_s, then drains its connection.")
    svc.add_argument("name", metavar="NAME", help="service name (see `rlbus services`), or several joined by + "
                     "to colocate them in one process on one event loop (e.g. trainer+rollout, which the inproc "
                     "weight transport needs); a colocated group stops as a whole when any part stops")
    add_bus_args(svc)
    svc.add_argument("--instance", metavar="ID", help="instance id (default: host-pid-random); a colocated part "
                     "gets this id with the group name replaced by its own (trainer+rollout-0 -> rollout-0)")
    svc.add_argument("--part-set", dest="part_overrides", action="append", default=[], metavar="PART:KEY=VALUE",
                     help="override a config key for one part of a colocated group only (e.g. its NATS login)")

    tap = sub.add_parser("tap", help="print bus messages as JSON lines",
                         description="Print messages of a subject or stream as JSON lines, decoded from msgpack "
                         "with the proto schema. TARGET is a subject (rlbus.RUN.heartbeat.>), a family name of "
                         "this run (heartbeat, prompts, rollouts, trajectories, outcomes, metrics, dlq, sandbox, weights), a channel "
                         "name of this run (sandbox_events, weight_announcements, ...: proto/catalog.py) "
                         "or a stream name in capitals (TRAJECTORIES). Without --from-start/--since it shows "
                         "new messages live; with them it replays what the stream stored.")
    tap.add_argument("target", metavar="SUBJECT_OR_STREAM")
    add_bus_args(tap)
    tap.add_argument("--from-start", action="store_true", help="replay the stream from its first message")
    tap.add_argument("--since", metavar="WHEN", help="replay from a time: 30s, 5m, 2h, 1d ago or ISO-8601")
    tap.add_argument("--count", type=int, metavar="N", help="stop after N messages")
    tap.add_argument("--until-end", action="store_true", help="with --from-start/--since: stop after the last "
                     "message the stream held when the tap started")
    tap.add_argument("--raw", action="store_true", help="do not apply the schema: schema-less msgpack or base64")

    st = sub.add_parser("status", help="members, stream depths, consumer lag, latest weight version",
                        description="Show the run's live members (from heartbeats), stream depths, the lag of "
                        "this run's consumers and the latest weight version.")
    add_bus_args(st)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                    help="refresh in place every SECONDS (default 2) until Ctrl-C")
    st.add_argument("--times", type=int, metavar="N", help=argparse.SUPPRESS)  # --watch: stop after N (tests)
    st.add_argument("--healthy", metavar="SERVICE", help="health check (containers, pods): exit 0 when an instance "
                    "of SERVICE on this host heartbeats (running or waiting for its gang), else 1")
    st.add_argument("--max-age-s", type=float, default=30.0, metavar="S",
                    help="with --healthy: the newest heartbeat may be this old (default 30)")

    sc = sub.add_parser("scale", help="change the number of rollout, judge or sandbox workers of a running run",
                        description="Tell the `rlbus up` / `rlbus run` of a run file to run N instances of a service "
                        "from now on (e.g. rollout=3): new workers join the service's queue group at once; removed "
                        "ones stop gracefully and what they had not acked is redelivered to the others. Only "
                        "workers that share a durable consumer scale (rollout, judge, sandbox); on a cluster, "
                        "use the orchestrator (KEDA, kubectl scale, docker compose --scale).")
    sc.add_argument("counts", nargs="+", metavar="SERVICE=N", help="e.g. rollout=3 judge=2")
    sc.add_argument("--config", "-c", metavar="CONFIG", default=None,
                    help=f"run file or example name of the running run (default: {DEFAULT_EXAMPLE})")
    sc.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the overrides the run was started with that change run.dir (repeatable)")

    prov = sub.add_parser("provision", help="create or update the run's streams, KV buckets and object stores",
                          description="Create every stream and KV bucket of the catalog and the run's weight "
                          "buckets with [nats] replicas, and bring existing ones to this version's definition: "
                          "replicas are only raised, storage is never changed. What rlbus up does before "
                          "services start; run it once (with a login that may update streams) before the "
                          "services of a deployment start.")
    add_bus_args(prov)

    tr = sub.add_parser("trace", help="a prompt group's trace as a tree with timings, from the run directory",
                        description="Print the trace of one prompt group (admission, rollout generation with its "
                        "turns and sandbox execs, judge graders, the trainer's receipt; then the train step that "
                        "used it and each engine's apply of the version that step sent), read from the span files "
                        "every service writes to <run dir>/traces. --slowest N prints the N groups that took "
                        "longest instead. Works on a running or finished run.")
    tr.add_argument("group_id", nargs="?", metavar="GROUP_ID", help="the group (its id as in trajectories/outcomes)")
    tr.add_argument("--slowest", type=int, metavar="N", help="the N groups slowest from admission to last span")
    tr.add_argument("--run-dir", metavar="DIR", help="the run directory (default: [run] dir of --config)")
    tr.add_argument("--config", "-c", metavar="FILE", help="run file (TOML) whose [run] dir holds the traces")
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable)")

    replay_cmd.add_parser(sub)
    config_cmd.add_parser(sub)

    sub.add_parser("services", help="list the services this installation can run",
                   description="List the service names `rlbus service NAME` and [launcher] services accept: the "
                   "built-in ones and any registered by other packages through the `rlbus.services` entry-point group.")

    sch = sub.add_parser("schema", help="write JSON Schemas of every bus message into proto/schemas/",
                         description="Write one JSON Schema per channel (and per reply type) of the channel table, "
                         "for stock tools reading the JSON form of messages (rlbus tap), plus index.json. "
                         "--check exits 1 when the files there are not current (CI).")
    sch.add_argument("--out", metavar="DIR", help="directory to write (default: proto/schemas of this checkout)")
    sch.add_argument("--check", action="store_true", help="write nothing; exit 1 naming stale files")
    simulate_cmd.add_parser(sub)
    doctor.add_parser(sub)
    return p


def _part_overrides(args: argparse.Namespace, parts: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {p: [] for p in parts}
    for item in args.part_overrides:
        part, sep, override = item.partition(":")
        if not sep or part not in out:
            raise ConfigError(f"--part-set {item!r}: expected PART:KEY=VALUE with PART one of {', '.join(parts)}")
        out[part].append(override)
    return out


def cmd_service(args: argparse.Namespace) -> int:
    from services.launcher import registry
    from services.runtime import lifeline, service

    parts = args.name.split("+")
    if len(set(parts)) != len(parts) or not all(parts):
        raise ConfigError(f"service {args.name!r}: a colocated group names each service once, joined by +")
    per_part = _part_overrides(args, parts)
    group = []
    for part in parts:
        cfg_cls, factory = registry.load(part)
        if part in BUILTIN_SERVICES:  # the whole run file is checked, and the service gets its view of it
            loaded = RunFile.load(args.config, None, overrides(args) + per_part[part]).loaded(part)
        else:  # a service of another package (entry point): its own section, typed by its own class
            loaded = load_service_config(part, cfg_cls, args.config, None, overrides(args) + per_part[part])
        instance = args.instance
        if instance and len(parts) > 1:
            instance = instance.replace(args.name, part) if args.name in instance else f"{instance}-{part}"
        group.append((part, factory, loaded, instance))
    service.setup_logging(args.name, group[0][2].common.log_level)
    lifeline.watch_launcher()  # started by a launcher: end with it (services/runtime/lifeline.py)
    service.install_uvloop()
    if len(group) == 1:
        name, factory, loaded, instance = group[0]
        return asyncio.run(service.serve(name, factory, loaded, instance))
    return asyncio.run(service.serve_colocated(group))


def cmd_tap(args: argparse.Namespace) -> int:
    from services.launcher.tap import tap

    async def go(nc, run_id):
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        await tap(nc, args.target, run_id, from_start=args.from_start, since=args.since, count=args.count,
                  raw=args.raw, stop=stop, until_end=args.until_end)

    asyncio.run(with_connection(args, go))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from services.launcher.status import collect, format_status

    if args.healthy:  # only the members bucket: a health check runs often
        from services.launcher.status import healthy_here, members

        async def read_members(nc, run_id):
            return {"run_id": run_id, "members": await members(nc.jetstream(), run_id)}

        ok, why = healthy_here(asyncio.run(with_connection(args, read_members)), args.healthy, args.max_age_s)
        print(why)
        return 0 if ok else 1
    if args.watch is not None:
        if args.watch <= 0 or args.json:
            raise ConfigError("rlbus status --watch takes a positive period and goes without --json")

        async def watch(nc, run_id):
            shown = 0
            while args.times is None or shown < args.times:
                text = format_status(await collect(nc, run_id))
                # home, clear to the end: the table is redrawn in place on a terminal
                print(f"\x1b[H\x1b[J{time.strftime('%H:%M:%S')} every {args.watch:g}s (Ctrl-C to stop)\n{text}",
                      flush=True)
                shown += 1
                if args.times is None or shown < args.times:
                    await asyncio.sleep(args.watch)  # the refresh period
            return 0

        try:
            return asyncio.run(with_connection(args, watch))
        except KeyboardInterrupt:
            return 0
    st = asyncio.run(with_connection(args, collect))
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from services.launcher.control import ControlError, request

    counts: dict[str, int] = {}
    for item in args.counts:
        name, sep, n = item.partition("=")
        if not sep or not name or not n.strip().isdigit():
            raise ConfigError(f"scale {item!r}: expected SERVICE=N with N a count, e.g. rollout=3")
        counts[name.strip()] = int(n)
    tree = load_tree(resolve_target(args.config or DEFAULT_EXAMPLE), None, args.overrides)
    run = convert(tree.get("run"), RunSection, "run")
    try:
        reply = request(run.dir, {"scale": counts})
    except ControlError as e:
        print(f"rlbus: {e}", file=sys.stderr)
        return 2
    if "error" in reply:
        print(f"rlbus: scale refused: {reply['error']}", file=sys.stderr)
        return 2
    print("services: " + ", ".join(f"{n}={c}" for n, c in reply["services"].items()))
    return 0


def cmd_provision(args: argparse.Namespace) -> int:
    from services.launcher.runfile import provision_run
    from services.runtime import bus

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runfile = RunFile.load(args.config, None, overrides(args))
    run, nats_cfg = bus_sections(args)
    nats_cfg.max_reconnect_attempts = 3  # an unreachable server is an error within seconds, not a wait forever

    async def go() -> None:
        nc = await bus.connect(nats_cfg, "rlbus-provision", first_attempts=3)
        try:
            await provision_run(nc.jetstream(), runfile)
        finally:
            await nc.close()

    asyncio.run(go())
    print(f"provisioned the streams and buckets of run {run.id} with {nats_cfg.replicas} replica(s)")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from services.launcher.trace import TraceError, load, render_group, slowest

    if (args.group_id is None) == (args.slowest is None):
        raise ConfigError("rlbus trace: give a GROUP_ID or --slowest N (one of them)")
    if args.slowest is not None and args.slowest < 1:
        raise ConfigError("rlbus trace: --slowest takes a positive number")
    run_dir = args.run_dir or convert(load_tree(args.config, None, list(args.overrides)).get("run"), RunSection,
                                      "run").dir
    try:
        traces = load(run_dir)
        groups = [args.group_id] if args.group_id is not None else slowest(traces, args.slowest)
        print("\n\n".join(render_group(traces, g) for g in groups))
    except TraceError as e:
        print(f"rlbus trace: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from services.launcher import schema

    return schema.main(args.out, args.check)


def cmd_services(args: argparse.Namespace) -> int:
    from services.launcher import registry

    print("\n".join(registry.names()))
    return 0


COMMANDS = {"run": run_cmd.cmd_run, "up": run_cmd.cmd_up, "service": cmd_service, "tap": cmd_tap, "status": cmd_status, "services": cmd_services,
            "trace": cmd_trace, "replay": replay_cmd.main, "config": config_cmd.main,
            "provision": cmd_provision, "schema": cmd_schema, "scale": cmd_scale, "simulate": simulate_cmd.main,
            "doctor": doctor.main}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"rlbus: configuration error: {e}", file=sys.stderr)
        # a service refused by its configuration tells its supervisor not to restart it (EX_CONFIG)
        return CONFIG_ERROR_EXIT if args.command == "service" else 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from services.launcher.registry import UnknownService
        from services.runtime.bus import BusError

        if isinstance(e, (UnknownService, BusError)):
            print(f"rlbus: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
