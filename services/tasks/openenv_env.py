"""OpenEnv environment servers as multi-turn environments: one prompt is one seeded episode of the server.

Run-file form::

    [task]
    name = "openenv"
    options = { server = "examples.openenv_guess:GuessTheNumber" }   # or url = "http://host:8000"

Needs the ``openenv-core`` package (``pip install "rlbus[envs]"``), imported only when this task is named.

**The server.** ``server`` is an import path (``module:ClassOrFactory``, or ``module:app`` for an app made with
openenv-core's ``create_app``; ``services/tasks/openenv_server.py`` says what it accepts). Each process that
needs the server (a rollout worker, for its episodes; the trainer, for the prompts) starts it once, lazily,
as a subprocess serving on a free port of 127.0.0.1, and keeps it: a watchdog
(:class:`services.runtime.lifeline.Reaper`) kills it when the process ends, however it ends. ``url`` names a
server already running instead (nothing is started or stopped). A server that is not up within
``start_timeout_s`` fails the episode (or the prompt) with the reason and the tail of its stderr. **A server
that dies** ends the episodes it was serving with an error naming it (the loop records
``finish_reason = "error"``), and the next episode starts a fresh one.

**A prompt is one seed.** The eval split is the seeds ``eval_seed .. eval_seed + eval_size - 1``; training
prompt ``k`` of run seed ``s`` has a seed hashed from ``(server, s, k)``, from 2**31 up. The prompt's messages
are the optional system message and the first observation of ``reset(seed)`` (the server's HTTP ``/reset``)
as the user turn. The episode's ``reset`` opens its own session (a WebSocket, one environment on the server),
resets it with the prompt's seed and checks that the observation is the prompt's: the environment's first
observation must be a function of its seed.

**Turns.** The assistant's text becomes the action (``action``): by default the whole text as the action's
``message`` field (OpenEnv's echo environment's action, and the shipped example's); ``action = "<field>"``
puts it in another string field; ``action = "json"`` sends the last JSON object in the text as the action's
fields (a text with none, or an action the server's action class rejects, is answered with the reason as the
next user message and the server's environment is not stepped). The observation (its fields, without
``reward``/``done``/``metadata``) becomes the next user message: the field named by ``observation``, else
the only field, else the fields as JSON. The observation's ``reward`` is the turn's reward and its ``done``
ends the episode; the judge's final score is 0, so the episode's reward is the sum of the server's rewards.
The session is closed when the episode ends (its last turn, or when the episode's state is dropped).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from services.runtime import lifeline
from services.runtime.config import ConfigError
from services.tasks.base import Prompt, Reward, encode_chat, encode_text, register_task
from services.tasks.env import Action, Start, Step

log = logging.getLogger("rlbus.tasks.openenv")

#: seeds: the eval split below TRAIN_SEED_BASE, the training stream from it up
TRAIN_SEED_BASE = 2**31
INSTALL_HINT = 'pip install "rlbus[envs]" (or pip install openenv-core)'
#: seconds a failed call waits for the server process to exit, to tell a dead server from another failure
DEATH_WAIT_S = 2.0
#: seconds a server gets between SIGTERM and SIGKILL when it is stopped
KILL_GRACE_S = 2.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local, or named


class OpenEnvError(ConfigError):
    """An option of the openenv task is unusable (the message names the key)."""


class ServerDied(RuntimeError):
    """The server process exited while an episode was talking to it."""


class ServerProcess:
    """One environment server, started on first use and again after it died; killed when this process ends."""

    def __init__(self, spec: str, max_sessions: int, start_timeout_s: float) -> None:
        self.spec, self.max_sessions, self.start_timeout_s = spec, max_sessions, start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0
        self._reaper: lifeline.Reaper | None = None
        self._stderr: Any = None
        self._lock = threading.Lock()

    def ensure(self) -> tuple[str, int]:
        """The running server's URL and pid (a fresh server if there is none, or it died)."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None:
                    log.warning("the OpenEnv server %s (pid %d) is gone (%s); starting a fresh one",
                                self.spec, self.proc.pid, _exit(self.proc.returncode))
                self._start()
            assert self.proc is not None
            return self.url, self.proc.pid

    def _start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        path = [os.getcwd() if p == "" else p for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "ENABLE_WEB_INTERFACE": "false"}
        if self._reaper is None:
            self._reaper = lifeline.Reaper(grace_s=KILL_GRACE_S)
        if self._stderr is not None:
            self._stderr.close()
        self._stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.tasks.openenv_server", self.spec, str(sock.fileno()),
                 str(self.max_sessions)], pass_fds=(sock.fileno(),), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._stderr)
        finally:
            sock.close()  # the server holds the only copy: when it dies, waiting connections fail at once
        self._reaper.track([self.proc.pid])
        self.url, self.starts = f"http://127.0.0.1:{port}", self.starts + 1
        try:  # the socket listens already: this request waits in its backlog until the server serves it
            with _NO_PROXY.open(f"{self.url}/health", timeout=self.start_timeout_s) as response:
                response.read()
        except (OSError, urllib.error.URLError) as e:
            try:
                self.proc.wait(DEATH_WAIT_S)
                why = f"it exited ({_exit(self.proc.returncode)})"
            except subprocess.TimeoutExpired:
                why = f"it did not answer /health within start_timeout_s = {self.start_timeout_s:g} s ({e})"
            self._kill()
            raise RuntimeError(f"the OpenEnv server {self.spec} did not start: {why}{self._stderr_tail()}") from e
        log.info("OpenEnv server %s serving at %s (pid %d)", self.spec, self.url, self.proc.pid)

    def death(self, pid: int) -> str | None:
        """Why the server ``pid`` is gone (waiting up to :data:`DEATH_WAIT_S`), or None while it runs."""
        proc = self.proc
        if proc is None or proc.pid != pid:
            return "it was replaced"
        try:
            proc.wait(DEATH_WAIT_S)
        except subprocess.TimeoutExpired:
            return None
        return f"{_exit(proc.returncode)}{self._stderr_tail()}"

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 600))
        lines = [line.strip() for line in self._stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return f"; its stderr ends: {' | '.join(lines[-3:])}" if lines else ""

    def _kill(self) -> None:
        if self._reaper is not None:
            self._reaper.kill()
        if self.proc is not None:
            self.proc.wait()  # reaped: no zombie

    def close(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after a grace) and its watchdog."""
        with self._lock:
            self._kill()
            if self._reaper is not None:
                self._reaper.close()
                self._reaper = None
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None


def _exit(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


@dataclass(eq=False)
class Session:
    """One episode's connection to the server (``Start.state``/``Step.state``): its client, the server's pid."""

    client: Any
    pid: int | None
    seed: int


def _close_client(loop: asyncio.AbstractEventLoop, client: Any) -> None:
    """Close a dropped session's WebSocket on its loop (a finalizer: any thread, the loop maybe closed)."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(lambda: loop.create_task(client.close(), name="openenv-session-close"))


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last JSON object written in ``text`` (None if there is none)."""
    decoder, found = json.JSONDecoder(), None
    for i, ch in enumerate(text):
        if ch == "{":
            try:
                obj, _ = decoder.raw_decode(text, i)
            except ValueError:
                continue
            if isinstance(obj, dict):
                found = obj
    return found


@register_task("openenv")
class OpenEnvTask:
    """An OpenEnv environment server as an environment (see the module docstring).

    Args:
        server: the environment to serve, ``module:ClassOrFactory`` (or ``module:app``); one of server, url.
        url: an OpenEnv server already running (``http://host:port``); one of server, url.
        action: how the assistant's text becomes the action: the name of a string field of the action
            (default ``message``: the whole text in it), or ``json``: the last JSON object in the text.
        observation: the observation field shown to the model; ``""``: the only field, else all as JSON.
        eval_size: seeds in the fixed eval split; eval_seed: the first one.
        system_prompt: a system message before the first observation; ``""``: none.
        max_new_tokens: the completion budget of one assistant turn.
        start_timeout_s: seconds a started server has to answer; past them the episode fails.
        max_sessions: sessions (concurrent episodes) one server holds (1 for an environment without
            ``SUPPORTS_CONCURRENT_SESSIONS``).
    """

    name = "openenv"
    stop: list[str] = []

    def __init__(self, server: str = "", url: str = "", action: str = "message", observation: str = "",
                 eval_size: int = 100, eval_seed: int = 20261202, system_prompt: str = "",
                 max_new_tokens: int = 256, start_timeout_s: float = 60.0, max_sessions: int = 64,
                 **unknown: Any) -> None:
        if unknown:
            known = [k for k in inspect.signature(OpenEnvTask).parameters if k != "unknown"]
            raise OpenEnvError(f"task.options.{sorted(unknown)[0]}: unknown option of the openenv task; "
                               f"known: {', '.join(known)}")
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as e:
            raise OpenEnvError(f"task 'openenv' needs the openenv-core package ({e}): {INSTALL_HINT}") from e
        if bool(server) == bool(url):
            raise OpenEnvError("task.options.server: name the environment to serve (module:ClassOrFactory), "
                               "or task.options.url a running server; one of the two")
        for key, value, low in (("eval_size", eval_size, 1), ("max_new_tokens", max_new_tokens, 1),
                                ("start_timeout_s", start_timeout_s, 0.1), ("max_sessions", max_sessions, 1)):
            if value < low:
                raise OpenEnvError(f"task.options.{key}: must be at least {low:g}, got {value}")
        if not 0 <= eval_seed <= TRAIN_SEED_BASE - eval_size:
            raise OpenEnvError(f"task.options.eval_seed: must be in 0..{TRAIN_SEED_BASE - eval_size}")
        if server:
            from services.tasks.openenv_server import load

            try:
                servable = load(server)
            except Exception as e:  # the user's module, any error: the option is what to change
                raise OpenEnvError(f"task.options.server: {server!r} cannot be served: {type(e).__name__}: "
                                   f"{e}") from e
            fields = servable.action_cls.model_fields if servable.action_cls is not None else None
            if fields is not None and action != "json" and action not in fields:
                raise OpenEnvError(f"task.options.action: {servable.action_cls.__name__} has no field {action!r} "
                                   f"(its fields: {', '.join(f for f in fields if f != 'metadata')}); or use "
                                   "'json'")
        self._client_cls = GenericEnvClient
        self.server, self.url, self.action, self.observation = server, url, action, observation
        self.eval_size, self.eval_seed, self.system_prompt = eval_size, eval_seed, system_prompt
        self.max_new_tokens, self.start_timeout_s = max_new_tokens, start_timeout_s
        self.process = ServerProcess(server, max_sessions, start_timeout_s) if server else None

    def close(self) -> None:
        """Stop this process's server (it is stopped anyway when the process ends)."""
        if self.process is not None:
            self.process.close()

    # --- the server ---

    def _endpoint(self) -> tuple[str, int | None]:
        if self.process is None:
            return self.url.rstrip("/"), None
        return self.process.ensure()

    def _name(self, pid: int | None) -> str:
        return f"the OpenEnv server {self.server} (pid {pid})" if pid is not None else f"the OpenEnv server {self.url}"

    async def _failed(self, session_pid: int | None, what: str, error: Exception) -> Exception:
        """The error to raise for a failed call: the server's death if it died, else the call's failure."""
        if self.process is not None and session_pid is not None:
            death = await asyncio.to_thread(self.process.death, session_pid)
            if death is not None:
                return ServerDied(f"{self._name(session_pid)} died during {what}: {death}; the next episode "
                                  "starts a fresh server")
        return RuntimeError(f"{self._name(session_pid)} failed {what}: {type(error).__name__}: {error}")

    def render(self, observation: dict[str, Any]) -> str:
        """The observation's text for the model (see the module docstring)."""
        if self.observation:
            if self.observation not in observation:
                raise KeyError(f"task.options.observation: the observation has no field {self.observation!r} "
                               f"(its fields: {', '.join(observation)})")
            value = observation[self.observation]
        elif len(observation) == 1:
            value = next(iter(observation.values()))
        else:
            value = observation
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    # --- prompts ---

    def _first(self, seed: int) -> str:
        """The first observation for ``seed``, from the server's HTTP ``/reset`` (a fresh environment)."""
        base, pid = self._endpoint()
        request = urllib.request.Request(f"{base}/reset", data=json.dumps({"seed": seed}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with _NO_PROXY.open(request, timeout=self.start_timeout_s) as response:
                return self.render(json.loads(response.read())["observation"])
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeError(f"{self._name(pid)} failed reset(seed={seed}): {type(e).__name__}: {e}") from e

    def _prompt(self, prompt_id: str, seed: int) -> Prompt:
        first = self._first(seed)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": first})
        return Prompt(id=prompt_id, text=first, messages=messages,
                      metadata={"server": self.server or self.url, "seed": str(seed)})

    def _train_seed(self, seed: int, position: int) -> int:
        key = f"openenv-train:{self.server or self.url}:{seed}:{position}".encode()
        return TRAIN_SEED_BASE + int.from_bytes(hashlib.sha256(key).digest()[:8]) % TRAIN_SEED_BASE

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless; prompt id ``openenv/train/<seed>/<position>``, one environment seed each."""
        for position in itertools.count(start):
            yield self._prompt(f"openenv/train/{seed}/{position}", self._train_seed(seed, position))

    @cached_property
    def _eval(self) -> list[Prompt]:
        return [self._prompt(f"openenv/eval/{k}", self.eval_seed + k) for k in range(self.eval_size)]

    def eval_prompts(self) -> list[Prompt]:
        """The held-out seeds; prompt id ``openenv/eval/<k>`` (seed ``eval_seed + k``)."""
        return list(self._eval)

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The chat template over the messages (contents joined by blank lines when the tokenizer has none)."""
        if not prompt.messages:
            raise ValueError(f"prompt {prompt.id} has no messages; openenv prompts are chat prompts")
        if getattr(tokenizer, "chat_template", None):
            return encode_chat(tokenizer, prompt.messages)
        return encode_text(tokenizer, "\n\n".join(m["content"] for m in prompt.messages) + "\n\n")

    # --- the environment ---

    async def reset(self, prompt: Prompt) -> Start:
        """A session of its own on the server, reset with the prompt's seed; its observation must be the prompt's."""
        try:
            seed = int(prompt.metadata["seed"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"prompt {prompt.id} carries no seed (metadata 'seed'); was it made by this task?") from e
        base, pid = await asyncio.to_thread(self._endpoint)
        client = self._client_cls(base_url=base, connect_timeout_s=self.start_timeout_s)
        session = Session(client=client, pid=pid, seed=seed)
        weakref.finalize(session, _close_client, asyncio.get_running_loop(), client)
        try:
            result = await client.reset(seed=seed)
        except Exception as e:  # a transport failure of any kind: the server's death, or the reason
            raise await self._failed(pid, f"reset(seed={seed})", e) from e
        if self.render(result.observation) != prompt.text:
            raise ValueError(f"{self._name(pid)} reset with seed {seed} shows another observation than prompt "
                             f"{prompt.id}: the environment's first observation is not a function of its seed")
        return Start(messages=list(prompt.messages or []), state=session)

    async def step(self, state: Session, action: Action) -> Step:
        """The assistant's text as the action; the observation as the next user message, its reward and done."""
        if self.action == "json":
            payload = last_json_object(action.text)
            if payload is None:
                return self._retry("Your reply holds no JSON object; write the action as one JSON object.", state)
        else:
            payload = {self.action: action.text}
        try:
            result = await state.client.step(payload)
        except RuntimeError as e:
            if "VALIDATION_ERROR" in str(e):  # the model's action, not the server, is wrong: it tries again
                return self._retry(f"The action was rejected: {e}", state)
            raise await self._failed(state.pid, f"step {action.index}", e) from e
        except Exception as e:
            raise await self._failed(state.pid, f"step {action.index}", e) from e
        reward = None if result.reward is None else float(result.reward)
        if result.done or action.final:
            await state.client.close()
            return Step(reward=reward, done=bool(result.done), state=state)
        return Step(observations=[{"role": "user", "content": self.render(result.observation)}], reward=reward,
                    state=state)

    def _retry(self, text: str, state: Session) -> Step:
        return Step(observations=[{"role": "user", "content": text}], state=state)

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """0.0: the server's rewards are the episode's turn rewards, which the judge adds to this."""
        return Reward(0.0, "the reward came from the OpenEnv server's turns")
