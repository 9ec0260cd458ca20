"""A trainer of many ranks: rank 0 (the service process) starts ranks 1..N-1 and drives them.

One service instance is one rank group. The service process is rank 0: it alone talks to the bus.
It starts the other ranks as child processes (``python -m services.trainer.ranks``) and sends
them commands over their stdin: ``init`` (config, model directory, rendezvous address), then the
name of each collective operation (an :class:`~services.trainer.rank_ops.Op`) with its arguments (a
step's batch, a checkpoint path), then ``stop``. Every rank runs that operation's function from the
table :data:`services.trainer.rank_ops.OPS`, so all of them issue the same torch.distributed
collectives in the same order; tensors move only through torch.distributed (gloo on CPU, NCCL on
GPUs), never through the pipes. A name not in the table stops the rank with an error.

Failure is all-or-nothing, bounded in time:

* a rank that dies (killed, out of memory) is noticed by a watcher thread of rank 0 at once; rank 0
  stops the others and exits non-zero, so the launcher restarts the whole group, which continues
  from the newest checkpoint or kept weight version (trajectories not yet trained on are
  redelivered: they are acked only after the step that used them is durable);
* when rank 0 dies, the kernel stops the other ranks (``PR_SET_PDEATHSIG``), and a rank whose
  stdin closes exits;
* a collective that hangs fails after ``rank_timeout_s``;
* after a failure rank 0's exit is bounded too (:meth:`RankGroup.close`): its collective threads get a
  few seconds to fail out, and the heap is frozen so the interpreter's final garbage collections skip
  it (over torch's millions of objects they took 1.5–4 s here, 20 s on a loaded machine).

Each rank writes ``<run dir>/ranks/rank-<r>.pid`` and logs to ``<run dir>/ranks/rank-<r>.log``. A group
over several nodes (``nnodes > 1``) is driven the same way: the other nodes' agents relay the commands to
their ranks (:mod:`services.trainer.nodes`). A node placed on CPUs gives each rank its own share of them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import msgspec

from services.runtime.natsd import free_port
from services.runtime.tasks import cancel_and_wait
from services.trainer import nodes
from services.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from services.trainer.rank_ops import Op

log = logging.getLogger("rlbus.trainer.ranks")

T = TypeVar("T")


class RankGroupFailed(RuntimeError):
    """A rank of the trainer's group died or could not start; the whole group stops."""


class RankGroup:
    """Rank 0's handle on ranks 1..N-1. Start it from the main thread (the kernel ties a child's
    death-with-parent signal to the thread that started it)."""

    def __init__(self, cfg: TrainerConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.dir = run_dir / "ranks"
        devices = cfg.devices
        self.init_method = (f"tcp://{devices.master_addr}:{devices.master_port}" if devices.nnodes > 1
                            else f"tcp://127.0.0.1:{free_port()}")
        self.procs: dict[int, subprocess.Popen[bytes] | nodes.RemoteNode] = {}  # other nodes: by their first rank
        self.reason = ""
        self.joined = False  # the other nodes' agents have connected (nnodes > 1)
        self.closing = False
        self.failed = asyncio.Event()
        self._waiters: set[threading.Event] = set()  # rank 0's calls in progress (guarded), woken by a failure
        self._threads: set[threading.Thread] = set()  # the threads running them (guarded)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(cls, cfg: TrainerConfig, run_dir: Path) -> RankGroup:
        group = cls(cfg, run_dir)
        group._loop = asyncio.get_running_loop()
        group.dir.mkdir(parents=True, exist_ok=True)
        (group.dir / "rank-0.pid").write_text(str(os.getpid()))
        mine = nodes.rank_cpus(cfg.devices, 0)
        if mine:  # rank 0 keeps the first share of the node's CPUs (threads to match); its ranks take the others
            import torch

            os.sched_setaffinity(0, mine)
            torch.set_num_threads(cfg.devices.num_threads or len(mine))
        for rank in range(1, cfg.devices.nproc_per_node):
            group._add(rank, nodes.start_rank(rank, cfg.devices, group.dir))
        log.info("trainer rank group: %d ranks on %d node(s) (pids here %s), rendezvous %s", cfg.devices.world_size,
                 cfg.devices.nnodes, [os.getpid(), *(p.pid for p in group.procs.values())], group.init_method)
        return group

    def _add(self, rank: int, proc: subprocess.Popen[bytes] | nodes.RemoteNode) -> None:
        self.procs[rank] = proc
        threading.Thread(target=self._watch, args=(rank, proc), name=f"trainer-rank-{rank}-watch", daemon=True).start()

    def _join_nodes(self) -> None:
        """The other nodes' agents connect (at most rank_timeout_s); each is watched like a local rank."""
        devices = self.cfg.devices
        try:
            joined = nodes.accept_nodes(devices, devices.rank_timeout_s)
        except (OSError, TimeoutError) as e:
            self._fail(f"trainer rank group: {e}")
            raise RankGroupFailed(self.reason) from e
        for node_rank, node in sorted(joined.items()):
            self._add(node_rank * devices.nproc_per_node, node)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes] | nodes.RemoteNode) -> None:
        code = proc.wait()
        if self.closing and code == 0:
            return
        self._fail(f"trainer rank {rank} (pid {proc.pid}) exited with code {code} (log {self.dir / f'rank-{rank}.log'})")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.reason:
                return
            self.reason = reason
            for waiter in self._waiters:
                waiter.set()
        log.error("%s: stopping the rank group", reason)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.failed.set)

    def init(self, model_dir: Path, ref_dir: Path | None = None, dtype: str = "float32") -> None:
        """Ranks 1..N-1 build their learners (and join the process group) from ``model_dir``, in ``dtype``
        (over several nodes: once every node has joined)."""
        if self.cfg.devices.nnodes > 1 and not self.joined:
            self._join_nodes()
            self.joined = True
        self._command("init", msgspec.json.encode(self.cfg), str(model_dir), self.init_method,
                      str(ref_dir) if ref_dir else "", dtype)

    def send(self, op: Op, *args: Any) -> None:
        """Tell every other rank to run operation ``op`` with ``args`` on its learner."""
        from services.trainer.rank_ops import op_named

        self._command(op_named(op).value, *args)

    def _command(self, name: str, *args: Any) -> None:
        data = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, proc in self.procs.items():
            if self.reason:
                raise RankGroupFailed(self.reason)
            try:
                pipe: IO[bytes] = proc.stdin  # type: ignore[assignment]  # always a pipe (start())
                pipe.write(data)
                pipe.flush()
            except (BrokenPipeError, OSError) as e:
                self._fail(f"trainer rank {rank} (pid {proc.pid}) is gone ({e})")
                raise RankGroupFailed(self.reason) from e

    def guarded(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (rank 0's part of a collective call), given up on as soon as a rank dies.

        It runs in a daemon thread of its own: a collective whose peer died may block until
        ``rank_timeout_s`` (NCCL; or the group's start waiting for a rank that will never join),
        and a daemon thread stuck there does not keep the process from exiting."""
        done = threading.Event()  # set when fn returns, or by _fail when a rank dies
        result: list[Any] = []
        error: list[BaseException] = []

        def call() -> None:
            try:
                result.append(fn(*args))
            except Exception as e:  # handed to the waiting thread, which raises it
                error.append(e)
            finally:
                done.set()
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=call, name=f"trainer-rank-0-{getattr(fn, '__name__', 'call')}", daemon=True)
        with self._lock:
            self._waiters.add(done)
            failed = bool(self.reason)
            if not failed:
                self._threads.add(thread)
        try:
            if not failed:
                thread.start()
                done.wait()
        finally:
            with self._lock:
                self._waiters.discard(done)
        if result:
            return result[0]
        if self.reason:  # a rank died: that is the cause, whatever this rank's call saw
            raise RankGroupFailed(self.reason) from (error[0] if error else None)
        raise error[0]

    async def until_failed(self, work: Any) -> Any:
        """Await ``work``; if a rank dies first, cancel it and raise RankGroupFailed."""
        task = asyncio.ensure_future(work)
        failed = asyncio.create_task(self.failed.wait(), name="trainer-rank-failure")
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if not task.done():
            await cancel_and_wait(task)
            if not task.cancelled() and task.exception() is not None:  # the failure below is the cause
                log.debug("trainer stopped after a rank failure: %r", task.exception())
            raise RankGroupFailed(self.reason)
        if task.exception() is not None and self.reason:
            raise RankGroupFailed(self.reason) from task.exception()
        return task.result()

    def close(self, timeout_s: float = 30.0, settle_s: float = 5.0) -> None:
        """Stop ranks 1..N-1 (cleanly when all are alive, else by SIGKILL) and leave the process group.

        After a failure rank 0 is about to exit non-zero for the launcher's restart, and how soon bounds
        the group's recovery: see :meth:`_settle`."""
        import torch.distributed as dist

        self.closing = True
        clean = not self.reason
        if clean:
            try:
                self._command("stop")
            except RankGroupFailed:
                clean = False
        for rank, proc in self.procs.items():
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError as e:  # a dead rank: what was still buffered for it cannot be flushed
                    log.debug("trainer rank %d: stdin not flushed (%s)", rank, e)
            try:
                proc.wait(timeout_s if clean else 5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # after a failure another thread may still be inside a collective (failing): leave the group to exit
        if clean and dist.is_initialized():
            dist.destroy_process_group()
        if not clean:
            self._settle(settle_s)

    def _settle(self, timeout_s: float) -> None:
        """Make the exit after a failure quick. Rank 0's collective threads get ``timeout_s`` to fail out
        (they see the dead rank's closed connections at once; a daemon thread still inside torch while the
        interpreter finalizes aborts the process). Then the heap is frozen: the interpreter's final garbage
        collections walk every object torch and transformers made, which took 1.5–4 s here and 20 s on a
        loaded machine after the service itself had stopped; frozen objects are skipped (the process is
        ending: nothing needs collecting)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            log.warning("trainer rank 0: %s still inside a collective after %.0fs; exiting anyway", stuck, timeout_s)
        gc.freeze()


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of ``rank`` of the run's trainer rank group, as it wrote it (None: not started yet)."""
    try:
        return int((run_dir / "ranks" / f"rank-{rank}.pid").read_text())
    except (OSError, ValueError):
        return None


def worker(rank: int, commands: IO[bytes]) -> int:
    """Rank ``rank`` (1..N-1): build the learner, then run the commands rank 0 sends until ``stop``."""
    import torch.distributed as dist

    from services.trainer import devices, rank_ops
    from services.trainer.learner import Learner

    name, (cfg_json, model_dir, init_method, ref_dir, dtype) = pickle.load(commands)
    if name != "init":
        raise RankGroupFailed(f"rank {rank}: expected 'init' first, got {name!r}")
    cfg = msgspec.json.decode(cfg_json, type=TrainerConfig)
    learner = Learner(cfg, Path(model_dir), devices.resolve(cfg, rank, dtype), rank=rank, init_method=init_method,
                      ref_dir=Path(ref_dir) if ref_dir else None)
    log.info("rank %d of %d ready on %s", rank, cfg.devices.world_size, learner.placement.device)
    while True:
        try:
            name, args = pickle.load(commands)
        except EOFError:
            log.error("rank %d: rank 0 went away; exiting", rank)
            return 1
        if name == "stop":
            break
        rank_ops.lookup(name)(learner, *args)
    dist.destroy_process_group()
    log.info("rank %d stopped", rank)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank (1..N-1) of a trainer rank group; started by rank 0")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank-{args.rank} %(name)s %(levelname)s %(message)s")
    sys.exit(worker(args.rank, sys.stdin.buffer))


if __name__ == "__main__":
    main()
