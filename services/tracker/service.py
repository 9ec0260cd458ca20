"""The tracker service: a run's metrics and completions in TensorBoard, Weights & Biases and trackio.

It follows three streams with durable consumers of its own (``catalog.TRACKER_READS``), so it
takes nothing from the trainer or the launcher, resumes where it stopped after a restart, and
can be started after the run on a finished run's streams:

* METRICS → scalars. Every report's values, at the report's step; reports without a step
  (rollout, judge) at the newest trainer step seen;
* TRAJECTORIES + OUTCOMES → the completions table: per trainer step, a sample of the
  trajectories trained in it (prompt, completion, reward, each grader's score, staleness),
  joined by ``table.CompletionSampler``.

Why a service and not the trainer's metrics sink: a tracker that is slow (W&B uploading, a
big table) never slows a training step, it runs wherever the bus is reachable, and the same
code replays a finished run. Handlers only queue records for the backends' threads
(``backends.BackendWorker``), so nothing here waits on a backend.

On stop, the tracker first reads what the streams already hold (bounded by ``catch_up_s``;
the trainer's last step is often still in flight when the launcher stops a finished run),
then writes every pending table and gives the backends ``flush_timeout_s`` to close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from proto import catalog
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.metrics import MetricsReport
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.runtime import bus
from services.runtime.config import Loaded
from services.runtime.consume import Consumer, Delivery
from services.runtime.service import ServiceContext
from services.tracker.backends import BackendWorker, make_writer
from services.tracker.config import TrackerConfig
from services.tracker.table import CompletionSampler

log = logging.getLogger("rlbus.tracker")

#: seconds between two looks at the consumers' backlog while catching up on stop
CATCH_UP_POLL_S = 0.2


class TrackerService:
    def __init__(self, cfg: TrackerConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.workers: list[BackendWorker] = []
        self.sampler = CompletionSampler(cfg.rows_per_step, cfg.max_text_chars, cfg.max_waiting, cfg.table_after_s)
        #: the newest trainer step seen on METRICS: the step of reports that carry none
        self.step = 0
        self.reports = 0
        self.tables = 0

    # --- records in ------------------------------------------------------------------------------

    def _submit(self, kind: str, *args: Any) -> None:
        for w in self.workers:
            w.submit(kind, *args)

    async def on_metrics(self, rep: MetricsReport, d: Delivery[MetricsReport]) -> None:
        if rep.step >= 0 and rep.service == "trainer":
            self.step = max(self.step, rep.step)
        if rep.values:
            self.reports += 1
            self._submit("scalars", rep.step if rep.step >= 0 else self.step, dict(rep.values), rep.created_at)

    async def on_trajectory(self, msg: ScoredGroup | ScoredTrajectory, d: Delivery[Any]) -> None:
        now = time.monotonic()
        for t in catalog.members(msg):
            self.sampler.add_trajectory(t, now)

    async def on_outcome(self, msg: OutcomeBatch | TrajectoryOutcome, d: Delivery[Any]) -> None:
        now = time.monotonic()
        for o in catalog.members(msg):
            self.sampler.add_outcome(o, now)
        self._write_tables()

    def _write_tables(self, force: bool = False) -> None:
        for table in self.sampler.ready(time.monotonic(), force=force):
            if table.rows:
                self.tables += 1
                self._submit("table", table)

    def counters(self) -> dict[str, float]:
        s = self.sampler
        out = {"tracker/reports": float(self.reports), "tracker/tables": float(self.tables),
               "tracker/waiting_trajectories": float(s.waiting), "tracker/forgotten": float(s.forgotten),
               "tracker/rows_missing": float(s.rows_missing), "tracker/late_outcomes": float(s.late_outcomes)}
        for w in self.workers:
            out[f"tracker/{w.name}/written"] = float(w.written)
            out[f"tracker/{w.name}/dropped"] = float(w.dropped)
        return out

    # --- the run ---------------------------------------------------------------------------------

    async def run(self, ctx: ServiceContext) -> None:
        for b in self.cfg.backends:
            writer = make_writer(b, self.run_dir, ctx.run_id)
            same = sum(w.writer.name == writer.name for w in self.workers)
            self.workers.append(BackendWorker(writer, self.cfg.queue_size, self.cfg.warn_every_s,
                                              label=f"{writer.name}-{same + 1}" if same else writer.name))
        for w in self.workers:
            w.start()
        log.info("tracker: following run %s into %s", ctx.run_id, ", ".join(w.name for w in self.workers) or "nothing")
        follow = asyncio.Event()  # the consumers' stop: set once caught up after ctx.stop
        handlers = {"metrics": self.on_metrics, "trajectories": self.on_trajectory, "outcomes": self.on_outcome}
        consumers = []
        for name, handler in handlers.items():
            cdef = catalog.TRACKER_READS[name].for_run(ctx.run_id)
            await bus.ensure_consumer(ctx.js, cdef)
            # METRICS one at a time, in order (a report without a step takes the newest step seen); the
            # completions sampler does not depend on order, so its streams are fetched in large batches
            consumers.append(Consumer(ctx.js, cdef, catalog.CHANNELS[name].msg_type, handler, run_id=ctx.run_id,
                                      dead_letters=ctx.dead_letters, concurrency=1 if name == "metrics" else 256,
                                      max_message_bytes=ctx.cfg.common.max_message_bytes,
                                      name=f"tracker:{cdef.stream}"))
        tasks = [asyncio.create_task(c.run(follow, ctx.cfg.common.drain_timeout_s), name=f"tracker-{c.name}")
                 for c in consumers]
        ticker = asyncio.create_task(self._tick(ctx, follow), name="tracker-tick")
        stopped = asyncio.create_task(ctx.stop.wait(), name="tracker-stop")
        try:
            done, _ = await asyncio.wait({*tasks, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for t in done - {stopped}:
                t.result()  # a consumer that ended by itself failed: re-raise
            await self._catch_up(ctx, consumers)
        finally:
            follow.set()
            stopped.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            self._write_tables(force=True)
            # all at once: a hung backend does not eat the others' time
            await asyncio.gather(*(asyncio.to_thread(w.close, self.cfg.flush_timeout_s) for w in self.workers))
            await ctx.report(self.counters(), step=self.step)
        log.info("tracker: stopped (%s)", ", ".join(f"{k}={v:.0f}" for k, v in self.counters().items()))

    async def _tick(self, ctx: ServiceContext, follow: asyncio.Event) -> None:
        """Write tables that timed out; report the tracker's own counters every ``report_every_s``."""
        period = min(self.cfg.report_every_s, self.cfg.table_after_s / 2)
        last_report = time.monotonic()
        while not follow.is_set():
            try:
                await asyncio.wait_for(follow.wait(), timeout=period)  # the tick period itself
            except TimeoutError:
                pass
            self._write_tables()
            if time.monotonic() - last_report >= self.cfg.report_every_s:
                last_report = time.monotonic()
                await ctx.report(self.counters(), step=self.step)

    async def _catch_up(self, ctx: ServiceContext, consumers: list[Consumer[Any]]) -> None:
        """Read on until the consumers have nothing left that was stored before the stop (bounded)."""
        deadline = time.monotonic() + self.cfg.catch_up_s
        while time.monotonic() < deadline:
            try:
                infos = [await ctx.js.consumer_info(c.cdef.stream, c.cdef.durable) for c in consumers]
            except Exception as e:  # the bus is going away with the run: stop with what we have
                log.info("tracker: cannot see the backlog on stop (%s)", e)
                return
            left = sum(i.num_pending + i.num_ack_pending for i in infos)
            if left == 0:
                return
            await asyncio.sleep(CATCH_UP_POLL_S)  # bounded by catch_up_s; the backlog has no wake-up to wait on
        log.warning("tracker: stopped with records still unread after %.0fs (restart the tracker on the run's "
                    "streams to write them)", self.cfg.catch_up_s)


def build(loaded: Loaded) -> TrackerService:
    """The service for a resolved config (section ``[services.tracker]``); writes under ``[run] dir``."""
    return TrackerService(loaded.service, Path(loaded.run.dir))
