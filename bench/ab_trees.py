"""The same `rlbus run` in two versions of the code, back to back in one invocation (A/B of a change).

    .venv/bin/python bench/ab_trees.py --before 8d2b9ec --rounds 2 -- addition \\
        --set services.trainer.total_steps=200 --set services.trainer.max_wall_s=0.0 \\
        --set services.trainer.eval.every=0 --set services.trainer.checkpoint_every=0

When a change renames run-file keys, ``--before-set KEY=VALUE`` (repeatable) gives the before side its own
spelling of the overrides, replacing the ``--set`` arguments after ``--`` on that side only::

    .venv/bin/python bench/ab_trees.py --before 468a3fe --rounds 2 \\
        --before-set services.trainer.total_steps=200 --before-set services.trainer.eval.every=0 ... \\
        -- addition --set services.trainer.total_steps=200 --set services.trainer.eval.every=0 ...

``--before`` is a git revision, checked out once into a temporary worktree; ``--after`` is this
working tree (default) or another revision. Both run with this checkout's ``.venv``; each run gets
its own run directory and run id, so nothing is shared between them. Runs alternate (before, after,
before, after, ...) so that a machine getting busier does not favour one side. The figure is the
trainer's own ``wall_s`` from ``summary.json`` (model loaded to final model saved), and the process
wall time beside it. The last line is JSON: both sides' times and ``after_over_before`` (< 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def checkout(rev: str, root: Path) -> Path:
    tree = root / f"tree-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                   stdout=subprocess.DEVNULL)
    return tree


def run_once(tree: Path, rlbus_args: list[str], run_dir: Path, run_id: str) -> dict[str, float]:
    cmd = [str(REPO / ".venv" / "bin" / "python"), "-m", "services.launcher.cli", "run", *rlbus_args,
           "--set", f"run.dir={run_dir}", "--set", f'run.id="{run_id}"']
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    summary = run_dir / "summary.json"
    if proc.returncode != 0 or not summary.is_file():
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"the run in {tree} failed (exit {proc.returncode}); its output is above")
    s = json.loads(summary.read_text())
    return {"trainer_wall_s": float(s["wall_s"]), "process_wall_s": wall, "steps": float(s["step"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision of the 'before' side")
    ap.add_argument("--after", default="", help="git revision of the 'after' side (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=1, help="before/after pairs to run (alternating)")
    ap.add_argument("--before-set", action="append", default=None, metavar="KEY=VALUE",
                    help="the before side's overrides (repeatable), instead of the --set arguments after -- "
                    "(for a change that renamed keys)")
    ap.add_argument("rlbus_args", nargs=argparse.REMAINDER, help="-- then the arguments of `rlbus run`")
    args = ap.parse_args()
    rlbus_args = [a for a in args.rlbus_args if a != "--"] or ["addition"]
    side_args = {"before": rlbus_args, "after": rlbus_args}
    if args.before_set is not None:
        positional = [a for i, a in enumerate(rlbus_args) if a != "--set" and (i == 0 or rlbus_args[i - 1] != "--set")]
        side_args["before"] = positional + [x for kv in args.before_set for x in ("--set", kv)]
    root = Path(tempfile.mkdtemp(prefix="rlbus-ab-"))
    trees = {"before": checkout(args.before, root), "after": checkout(args.after, root) if args.after else REPO}
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    try:
        for r in range(args.rounds):
            for side, tree in trees.items():
                res = run_once(tree, side_args[side], root / f"run-{side}-{r}", f"ab{side}{r}")
                results[side].append(res)
                print(f"[ab] round {r} {side}: trainer {res['trainer_wall_s']:.1f} s, process "
                      f"{res['process_wall_s']:.1f} s, {res['steps']:.0f} steps", file=sys.stderr, flush=True)
    finally:
        for tree in trees.values():
            if tree != REPO:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)
    med = {side: statistics.median(x["trainer_wall_s"] for x in rs) for side, rs in results.items()}
    print(json.dumps({"before": args.before, "after": args.after or "working tree", "rounds": args.rounds,
                      "before_trainer_wall_s": [x["trainer_wall_s"] for x in results["before"]],
                      "after_trainer_wall_s": [x["trainer_wall_s"] for x in results["after"]],
                      "before_process_wall_s": [x["process_wall_s"] for x in results["before"]],
                      "after_process_wall_s": [x["process_wall_s"] for x in results["after"]],
                      "after_over_before": med["after"] / med["before"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
