"""How fast each side's held-out reward rises, pooled over seeds: a steadier reading than time to a target.

``bench/longtail.py`` (and ``bench/async_vs_sync.py``) give, per side, a reward curve of (step, trainer
seconds, held-out reward) points. Time to the lower final reward reads two noisy points of each curve; when
the reward rises ~0.1 over a run and one evaluation is worth +-0.02, that figure swings from 0.5 to 2 between
seeds. This reads every point instead: per side, the rise over each seed's own step-0 reward is fitted as a
line through the origin, against seconds and against steps, pooling the seeds (the step-0 evaluation is the
same request on both sides of a seed, so it is their common start). With ``A`` the asynchronous side and
``S`` the synchronous one:

* ``time_ratio``  = slope_A(per s) / slope_S(per s): how many times faster A gains reward (> 1: A is faster
  to any reward on the fitted line; the issue's "time to the same reward" ratio);
* ``steps_ratio`` = slope_S(per step) / slope_A(per step): A's steps over S's to the same reward (<= 1.1:
  sample efficiency kept);

each with its standard error (from the fits' residuals, by the delta method). A line is what 20-40 steps of
a slowly rising curve support; the residuals say when it is not.

    .venv/bin/python bench/reward_slopes.py LOG [LOG ...] [--sync sync-pooled --async async-pooled]

Each LOG is a file whose last line is a bench's JSON (``bench/longtail.py ... > LOG``). The last stdout line
is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def rises(curves: list[list[list[float]]], axis: int) -> list[tuple[float, float]]:
    """(x, reward - the seed's step-0 reward) of every point after step 0, pooled; ``axis`` 0: steps, 1: seconds.
    Each curve is [[step, seconds, reward], ...] starting at step 0."""
    points = []
    for curve in curves:
        if not curve or curve[0][0] != 0:
            raise ValueError(f"a curve must start at step 0: {curve[:1]}")
        start = curve[0][2]
        points += [(float(p[axis]), float(p[2]) - start) for p in curve[1:]]
    return points


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope through the origin and its standard error."""
    sxx = sum(x * x for x, _ in points)
    if len(points) < 2 or sxx <= 0:
        raise ValueError(f"need two points past step 0 to fit a slope, got {len(points)}")
    b = sum(x * y for x, y in points) / sxx
    resid = sum((y - b * x) ** 2 for x, y in points) / (len(points) - 1)
    return b, math.sqrt(resid / sxx)


def ratio(num: tuple[float, float], den: tuple[float, float]) -> tuple[float | None, float | None]:
    """num / den and its standard error (delta method); None when the denominator does not rise."""
    (a, sa), (b, sb) = num, den
    if b <= 0:
        return None, None
    r = a / b
    return r, abs(r) * math.sqrt((sa / a) ** 2 + (sb / b) ** 2) if a else sb / b


def figures(results: list[dict[str, Any]], sync_side: str, async_side: str) -> dict[str, Any]:
    """The slopes of both sides over every result (one bench JSON per seed) and the two ratios."""
    out: dict[str, Any] = {"seeds": [r.get("seed") for r in results], "sync": sync_side, "async": async_side}
    fits = {}
    for side in (sync_side, async_side):
        curves = []
        for r in results:
            if side not in r.get("sides", {}):
                raise ValueError(f"seed {r.get('seed')}: no side {side!r} (sides: {sorted(r.get('sides', {}))})")
            curves.append(r["sides"][side]["curve"])
        per_s, per_step = slope(rises(curves, 1)), slope(rises(curves, 0))
        fits[side] = {"per_100s": per_s, "per_step": per_step}
        out[side] = {"reward_per_100s": round(100 * per_s[0], 5), "se_per_100s": round(100 * per_s[1], 5),
                     "reward_per_step": round(per_step[0], 5), "se_per_step": round(per_step[1], 5),
                     "points": len(rises(curves, 0))}
    t, t_se = ratio(fits[async_side]["per_100s"], fits[sync_side]["per_100s"])
    s, s_se = ratio(fits[sync_side]["per_step"], fits[async_side]["per_step"]) if fits[async_side]["per_step"][0] > 0 \
        else (None, None)
    out["time_ratio"] = None if t is None else round(t, 3)
    out["time_ratio_se"] = None if t_se is None else round(t_se, 3)
    out["steps_ratio"] = None if s is None else round(s, 3)
    out["steps_ratio_se"] = None if s_se is None else round(s_se, 3)
    return out


def last_json(path: Path) -> dict[str, Any]:
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"{path}: no JSON line")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path, help="files ending with a bench's JSON line, one per seed")
    p.add_argument("--sync", default="sync-pooled", help="the synchronous side's name (default sync-pooled)")
    p.add_argument("--async", dest="async_side", default="async-pooled",
                   help="the asynchronous side's name (default async-pooled)")
    args = p.parse_args(argv)
    try:
        out = figures([last_json(f) for f in args.logs], args.sync, args.async_side)
    except (OSError, ValueError) as e:
        print(f"reward_slopes: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
