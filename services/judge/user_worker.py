"""What a user-code worker (``services/lib/user_worker.py``) runs for the judge: a task's method.

:func:`call_task` builds the task once per worker process (importing the module that defines it first, so
tasks registered by a decorator in a plugin module are found) and keeps it for later calls; the judge sends
only the task's name, options and the method's arguments (``services/judge/user_code.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

#: this worker process's tasks, by the judge's key (name and options): built on first use, kept
_TASKS: dict[str, Any] = {}


def call_task(key: str, module: str, name: str, options: dict[str, Any], method: str, args: tuple[Any, ...]) -> Any:
    """``<the task>.<method>(*args)``, the task built (once) as the judge built it."""
    if key not in _TASKS:
        from services.tasks import get_task

        if module and module != "__main__":
            importlib.import_module(module)  # registers a decorated task the entry points do not name
        _TASKS[key] = get_task(name, **options)
    return getattr(_TASKS[key], method)(*args)
