"""The services the launcher knows, each loaded lazily (config first, heavy imports after).

Each entry returns ``(config class, factory)``; the factory builds the service
from its resolved config. Entry-point group ``rlbus.services`` adds more
without touching this file.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

Spec = tuple[type[Any], Callable[[Any], Any]]


def _echo() -> Spec:
    from services.echo import config, service

    return config.EchoConfig, service.build


def _trainer() -> Spec:
    from services.trainer import config, service

    return config.TrainerConfig, service.build


def _rollout() -> Spec:
    from services.rollout import config, service

    return config.RolloutConfig, service.build


def _judge() -> Spec:
    from services.judge import config, service

    return config.JudgeConfig, service.build


def _sandbox() -> Spec:
    from services.sandbox import config, service

    return config.SandboxConfig, service.build


def _weightsync() -> Spec:
    from services.weightsync import config, service

    return config.WeightsyncConfig, service.build


def _teacher() -> Spec:
    from services.teacher import config, service

    return config.TeacherConfig, service.build


def _tracker() -> Spec:
    from services.tracker import config, service

    return config.TrackerConfig, service.build


_BUILTIN: dict[str, Callable[[], Spec]] = {
    "weightsync": _weightsync,
    "sandbox": _sandbox,
    "echo": _echo,
    "trainer": _trainer,
    "rollout": _rollout,
    "judge": _judge,
    "tracker": _tracker,
    "teacher": _teacher,
}


def register(name: str, loader: Callable[[], Spec]) -> None:
    _BUILTIN[name] = loader


class UnknownService(KeyError):
    def __str__(self) -> str:
        return f"unknown service {self.args[0]!r}; known: {', '.join(sorted(names()))}"


def _entry_points() -> dict[str, Callable[[], Spec]]:
    found: dict[str, Callable[[], Spec]] = {}
    for ep in metadata.entry_points(group="rlbus.services"):
        found[ep.name] = ep.load
    return found


def names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_entry_points()))


def load(name: str) -> Spec:
    loader = _BUILTIN.get(name) or _entry_points().get(name)
    if loader is None:
        raise UnknownService(name)
    return loader()
