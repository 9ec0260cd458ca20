"""``rlbus replay``: recompute a recorded train step (``replay step N``), or list and re-publish a family's
dead letters (``replay dlq``). The work itself is :mod:`services.launcher.replay`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any

from services.launcher.connect import add_bus_args, with_connection
from services.runtime.config import RunSection, convert, load_tree


def add_parser(sub: Any) -> None:
    rp = sub.add_parser("replay", help="recompute a recorded train step from the run directory",
                        description="replay step N: rebuild trainer step N of a run from its run directory (the "
                        "trajectories it trained on, in batch order, from the stored streams; the weights of version "
                        "N-1 from the run's weight store), recompute its loss and gradient norm with the trainer's "
                        "code and compare them with metrics.jsonl (bit-identical on the CPU). Exit 0 when identical, "
                        "1 when they differ, 2 when the step cannot be rebuilt (the message says what is missing).")
    rps = rp.add_subparsers(dest="what", required=True, metavar="{step,dlq}")
    rstep = rps.add_parser("step", help="recompute trainer step N and compare it with what was recorded")
    rstep.add_argument("n", type=int, metavar="N", help="the trainer step (from 1)")
    rstep.add_argument("--run-dir", metavar="DIR", help="the run directory (default: [run] dir of --config)")
    rstep.add_argument("--config", "-c", metavar="FILE", help="run file (TOML) whose [run] dir is replayed")
    rdlq = rps.add_parser("dlq", help="list a family's dead letters; --publish sends them to their subjects again",
                          description="List the dead letters of FAMILY (rollouts, trajectories, prompts, ...) with "
                          "why each failed; after inspection (and a fix of what failed them), --publish re-publishes "
                          "their original payloads to their original subjects, each with a new message id. The "
                          "dead letters themselves stay on record. Works on a live run, or on a finished one "
                          "with --run-dir.")
    rdlq.add_argument("--family", required=True, metavar="FAMILY", help="the family of the failed messages")
    rdlq.add_argument("--publish", action="store_true", help="re-publish them (default: only list)")
    rdlq.add_argument("--fix", action="append", default=[], metavar="PATH=VALUE",
                      help="change a field before re-publishing (implies --publish; repeatable): dotted path, "
                           "list indices as numbers, VALUE a JSON literal (else text), e.g. "
                           "--fix ticket.metadata.answer='\"5\"';"
                           " a fix that names no field, or leaves an invalid message, sends nothing")
    rdlq.add_argument("--seq", type=int, action="append", metavar="N",
                      help="only the dead letter with this DLQ sequence number (repeatable)")
    add_bus_args(rdlq)


def main(args: argparse.Namespace) -> int:
    from services.launcher.accounting import Undecodable
    from services.launcher.replay import ReplayError, dead_letters, replay_step, republish

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.what == "dlq":
        async def go(nc, run_id):
            skipped = Undecodable()
            letters = await dead_letters(nc, run_id, args.family, skipped)
            if skipped.total:  # said first, on stdout with the listing: a garbage entry is not a dead letter
                print(f"note: {skipped.note()}")
            if args.seq:
                letters = [x for x in letters if x.seq in set(args.seq)]
            for x in letters:
                print(x.line())
            if not letters:
                print(f"no dead letters of family {args.family!r} in run {run_id}")
            elif args.publish or args.fix:
                n = await republish(nc, letters, attempt=str(time.time_ns()), fixes=args.fix)
                fixed = f" with {len(args.fix)} fix(es)" if args.fix else ""
                print(f"re-published {n} message(s){fixed} to their original subjects")
            return 0

        try:
            return asyncio.run(with_connection(args, go))
        except ReplayError as e:
            print(f"rlbus replay: {e}", file=sys.stderr)
            return 2
    run_dir = args.run_dir or convert(load_tree(args.config, None, []).get("run"), RunSection, "run").dir
    try:
        result = replay_step(run_dir, args.n)
    except ReplayError as e:
        print(f"rlbus replay: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.identical else 1
