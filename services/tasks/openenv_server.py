"""Serving one OpenEnv environment: what ``server = "module:Name"`` names, and the server process itself.

``python -m services.tasks.openenv_server SPEC FD MAX_SESSIONS`` serves SPEC with uvicorn on the listening
socket FD, which the parent bound (``127.0.0.1``, a free port) and handed over: no port race, and a
connection made before the server accepts waits in the socket's backlog instead of failing. Started by
``services/tasks/openenv_env.py``; runnable by hand for a look at what a spec serves.

SPEC is ``module:attribute``, the attribute one of

* an OpenEnv ``Environment`` subclass declared with its types (``class Env(Environment[Act, Obs, State])``),
  served with openenv-core's ``create_fastapi_app``, one environment per session;
* a factory (a function returning such an environment), its return annotation naming the class;
* an ASGI app already made with openenv-core (``app = create_app(...)``, as OpenEnv's ``server/app.py``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from dataclasses import dataclass
from typing import Any


class ServerSpecError(ValueError):
    """The spec names nothing servable (the message says what it found)."""


@dataclass
class Servable:
    """What a spec names: an app, or an environment factory with its action and observation classes."""

    spec: str
    app: Any = None
    factory: Any = None
    action_cls: Any = None
    observation_cls: Any = None
    concurrent: bool = True

    def make_app(self, max_sessions: int) -> Any:
        if self.app is not None:
            return self.app
        from openenv.core.env_server import create_fastapi_app

        return create_fastapi_app(self.factory, self.action_cls, self.observation_cls,
                                  max_concurrent_envs=max_sessions if self.concurrent else 1)


def _types_of(cls: type) -> tuple[Any, Any] | None:
    """The (action, observation) classes an Environment subclass declared in its bases."""
    from openenv.core.env_server import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if (len(args) >= 2 and inspect.isclass(args[0]) and issubclass(args[0], Action)
                    and inspect.isclass(args[1]) and issubclass(args[1], Observation)):
                return args[0], args[1]
    return None


def load(spec: str) -> Servable:
    """Import ``spec`` and say what it serves; :class:`ServerSpecError` (or the import's error) if nothing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ServerSpecError(f"{spec!r} is not an import path of the form 'module:ClassOrFactory'")
    module = importlib.import_module(module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ServerSpecError(f"module {module_name!r} has no {attr!r}") from None
    from openenv.core.env_server import Environment

    if not inspect.isclass(obj) and callable(obj) and hasattr(obj, "router"):  # a FastAPI/Starlette app
        return Servable(spec=spec, app=obj)
    cls = obj
    if not inspect.isclass(obj) and callable(obj):
        cls = typing.get_type_hints(obj).get("return") if inspect.isfunction(obj) else None
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ServerSpecError(f"{spec} is a {type(obj).__name__}, not an OpenEnv Environment subclass, a "
                              "factory annotated to return one, or an app made with openenv's create_app")
    types = _types_of(cls)
    if types is None:
        raise ServerSpecError(f"{cls.__name__} does not declare its action and observation classes: subclass "
                              "Environment[MyAction, MyObservation, State], or serve an app made with create_app")
    return Servable(spec=spec, factory=obj, action_cls=types[0], observation_cls=types[1],
                    concurrent=bool(getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False)))


def main(argv: list[str]) -> None:
    spec, fd, max_sessions = argv[0], int(argv[1]), int(argv[2])
    import uvicorn

    app = load(spec).make_app(max_sessions)
    uvicorn.Server(uvicorn.Config(app, fd=fd, log_level="warning")).run()


if __name__ == "__main__":
    main(sys.argv[1:])
