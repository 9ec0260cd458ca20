"""Render a run's TensorBoard scalars as a PNG, from the event files the tracker wrote.

    python -m services.tracker.plot RUN_DIR [--out scalars.png] [--tag TAG ...]

For documentation and for a look without a TensorBoard server: one panel per tag, the raw values
faint and an exponential moving average (TensorBoard's default smoothing, 0.6) on top. Needs
tensorboard (the tracker extra) and matplotlib (the examples extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: the panels drawn when no --tag is given (those the run has)
DEFAULT_TAGS = ("eval/reward", "train/reward_mean", "trainer/loss", "trainer/staleness_mean",
                "rollout/tokens_per_s", "trainer/step_s")
SMOOTHING = 0.6


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's debiased exponential moving average."""
    out, last, n = [], 0.0, 0
    for v in values:
        n += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** n))
    return out


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] from every event file under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def render(logdir: Path, out: Path, tags: list[str] | None = None, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = scalars(logdir)
    chosen = [t for t in (tags or DEFAULT_TAGS) if t in data]
    if not chosen:
        raise SystemExit(f"no scalars {list(tags or DEFAULT_TAGS)} in {logdir} (it has: {', '.join(sorted(data))})")
    cols = min(3, len(chosen))
    rows = (len(chosen) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.2 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, chosen, strict=False):
        steps = [s for s, _ in data[tag]]
        values = [v for _, v in data[tag]]
        ax.plot(steps, values, color="#f57c00", alpha=0.25, linewidth=1)
        ax.plot(steps, smooth(values), color="#f57c00", linewidth=1.8)
        ax.set_title(tag, fontsize=10, loc="left")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(title or f"TensorBoard scalars: {logdir}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.tracker.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory (its tensorboard/ is read) or an event-file directory")
    p.add_argument("--out", type=Path, default=Path("scalars.png"))
    p.add_argument("--tag", action="append", dest="tags", help="a scalar to draw (repeatable)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    logdir = args.run_dir / "tensorboard" if (args.run_dir / "tensorboard").is_dir() else args.run_dir
    print(render(logdir, args.out, args.tags, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
