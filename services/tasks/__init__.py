"""Tasks: prompt sources plus reward functions, found by name.

``get_task(name, **options)`` returns a :class:`Task`. Built-in tasks
(``addition``, ``word_problems``, ``word_problems_calculator``, ``dataset``) register on import of this package, ``coding`` and
``reasoning_gym``, ``textarena``, ``openenv`` when first named; others
come from the ``rlbus.tasks`` entry-point group (see ``services.tasks.base``).
Model builders for the examples (``tiny_model``, ``smollm2``) import torch and
are not imported here.
"""

from services.tasks import addition, calculator, dataset, word_problems  # noqa: F401  (registers the built-ins; coding, reasoning_gym, textarena, openenv load lazily)
from services.tasks.base import (
    ENTRY_POINT_GROUP,
    Prompt,
    Reward,
    Task,
    TaskRegistrationError,
    UnknownTaskError,
    available_tasks,
    encode_chat,
    encode_text,
    get_task,
    register_task,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Prompt",
    "Reward",
    "Task",
    "TaskRegistrationError",
    "UnknownTaskError",
    "available_tasks",
    "encode_chat",
    "encode_text",
    "get_task",
    "register_task",
]
