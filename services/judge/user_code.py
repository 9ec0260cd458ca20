"""The judge's bounded runner for user code (tasks' reward functions and hidden-test builders).

The calls run in worker processes (:class:`services.lib.user_code.WorkerPool`, which says why processes and
not threads, and how the pool grows past stuck workers and renices them): a call that does not return within
``timeout_s`` has its worker killed (SIGKILL) and replaced; one whose worker dies (a segfault in a C
extension, the memory limit) too. Either way the call raises :class:`UserCodeError` and the sample is scored
failed.

Each worker builds the judge's tasks itself, once (:func:`services.judge.user_worker.call_task`), from the
task name, its options and the module defining it; the judge sends only the arguments. Workers start on first
use; calls wait for a free worker (the wait is not charged to the call's timeout).

**A hang costs its own group, not the run** (``bench/user_code.py --pipeline`` measures it). Two rules:

* *The pool grows on demand* past workers stuck in a call (``grow_after_s``), up to ``max_workers``, and
  runs the stuck ones at the lowest CPU priority (``services/lib/user_code.py``).
* *A group's first call probes for the rest*: calls made with the same ``scope`` (the judge passes the
  prompt group) to the same method wait for the first one to return; if it, or any later one, does not
  return within ``timeout_s``, the group's calls still to come fail at once with that reason instead of
  each hanging for ``timeout_s`` (the samples of a group share their prompt, the usual cause of a hang).
  The probe costs one call's latency per group, on the groups' own critical path only.

**rlbus's own bounded rewards run in the judge** (``builtin_in_process``): a task class shipped in
``services.tasks`` that sets ``reward_in_process = True`` on the class that defines its ``reward`` (a pure
check of a bounded completion, linear in its length: the addition task's exact match, the word problems'
last number) is called directly, which saves a worker round trip per sample. Any other module's task, a
subclass that overrides ``reward`` without declaring it again, and every other method go to the workers.
An exception there is still the sample's failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from services.judge.config import UserCodeConfig
from services.lib.user_code import STUCK_NICE as STUCK_NICE  # the tests read it here
from services.lib.user_code import UserCallFailed, Worker, WorkerPool, WorkerPoolError
from services.tasks.graders import UserCodeError

log = logging.getLogger("rlbus.judge.user_code")

#: the function each worker runs for the judge (it builds the task, then calls its method)
CALL_TASK = ("services.judge.user_worker", "call_task")


class UserCodeRunnerError(RuntimeError):
    """The runner, not the user's code, failed a call (a frame the worker could not decode): not the task's
    verdict, so the judge retries the message instead of scoring the sample failed."""


class _Scope:
    """The calls of one group to one method: the first one's outcome, and why the rest fail (if they do)."""

    def __init__(self) -> None:
        self.probe: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.failed: str | None = None


#: the package whose tasks may declare their reward bounded (``reward_in_process``)
BUILTIN_TASKS = "services.tasks."


def bounded_builtin(task: Any, method: str) -> bool:
    """Whether ``task.<method>`` is one of rlbus's own rewards declared bounded (see the module docstring):
    the class in the task's MRO that defines ``method`` is in :data:`BUILTIN_TASKS` and sets
    ``reward_in_process = True`` itself."""
    if method != "reward":
        return False
    owner = next((c for c in type(task).__mro__ if method in vars(c)), None)
    return (owner is not None and owner.__module__.startswith(BUILTIN_TASKS)
            and vars(owner).get("reward_in_process") is True)


#: scopes remembered (a group's calls come together; older ones are long finished)
SCOPES_KEPT = 4096


class ProcessUserCode:
    """``workers`` worker processes, growing to ``max_workers`` on demand; each call bounded by ``timeout_s``
    (see the module docstring).

    ``task_options`` are the judge's per-task options, so a worker builds the same task the judge has.
    ``restarts`` counts the workers replaced (after a timeout or a death), ``grown`` the workers started
    beyond ``workers``, ``group_failed`` the calls failed at once after a timeout in their group; the
    judge reports them.
    """

    def __init__(self, cfg: UserCodeConfig, task_options: dict[str, dict[str, Any]]) -> None:
        self.cfg = cfg
        self.task_options = task_options
        self.pool = WorkerPool(cfg, log, "user-code")
        self.group_failed = 0
        self.in_process = 0  # calls of bounded builtin rewards made in the judge itself
        self._scopes: OrderedDict[tuple[str, str, str], _Scope] = OrderedDict()

    @property
    def workers(self) -> list[Worker]:
        return self.pool.workers

    @property
    def calls(self) -> int:
        return self.pool.calls

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    @property
    def grown(self) -> int:
        return self.pool.grown

    @property
    def retired(self) -> int:
        return self.pool.retired

    async def call(self, task_name: str, task: Any, method: str, *args: Any, scope: str | None = None) -> Any:
        """``task.<method>(*args)`` in a worker; ``scope`` (a prompt group's id) joins calls whose first
        timeout fails the rest at once (see the module docstring)."""
        if self.cfg.builtin_in_process and bounded_builtin(task, method):
            self.in_process += 1
            try:
                return getattr(task, method)(*args)
            except Exception as e:  # a bug or a bad prompt: the sample's failure, as from a worker
                log.info("task %s.%s() raised %s: %s", task_name, method, type(e).__name__, e)
                raise UserCodeError("exception", f"{method}() raised {type(e).__name__}: {e}") from e
        if scope is None:
            return await self._call(task_name, task, method, args)
        key = (scope, task_name, method)
        state = self._scopes.get(key)
        probing = state is None
        if state is None:
            state = self._scopes[key] = _Scope()
            while len(self._scopes) > SCOPES_KEPT:
                self._scopes.popitem(last=False)
        elif not state.probe.done():
            await asyncio.shield(state.probe)
        try:
            if state.failed is not None:
                self.group_failed += 1
                raise UserCodeError("timeout", state.failed)
            try:
                return await self._call(task_name, task, method, args)
            except UserCodeError as e:
                if e.kind == "timeout":
                    state.failed = (f"{method}() was not called: it did not return within {self.cfg.timeout_s:g} s "
                                    "for another sample of this group (same prompt)")
                raise
        finally:
            if probing and not state.probe.done():
                state.probe.set_result(None)

    async def _call(self, task_name: str, task: Any, method: str, args: tuple[Any, ...]) -> Any:
        options = dict(self.task_options.get(task_name, {}))
        key = f"{task_name}:{sorted(options.items())!r}"
        module = type(task).__module__
        try:
            return await self.pool.call(*CALL_TASK, (key, module, task_name, options, method, args),
                                        timeout_s=self.cfg.timeout_s, label=f"{method}()")
        except UserCallFailed as e:
            if e.kind == "exception":
                log.info("user code %s.%s() raised %s\n%s", task_name, method, e, e.traceback)
                raise UserCodeError("exception", f"{method}() raised {e}") from None
            if e.kind == "import":  # the judge's own module: not the task's verdict
                raise UserCodeRunnerError(f"{e} (task {task_name})") from e
            raise UserCodeError(e.kind, str(e)) from None  # timeout or crash, said as the pool says it
        except WorkerPoolError as e:
            raise UserCodeRunnerError(f"{e} (task {task_name})") from e

    async def close(self) -> None:
        await self.pool.close()
