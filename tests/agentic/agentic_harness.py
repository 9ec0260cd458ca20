"""Helpers for the agentic tests: a scripted stand-in engine, a char-level chat tokenizer, services in-process.

The :class:`ScriptedEngine` is a **stand-in policy**: it satisfies the ``Engine`` protocol but, instead of a
model, replies with a fixed sequence of messages (tool calls, then a final answer), chosen by how many
assistant turns the conversation already has. Its logprobs and versions are fake but deterministic, so the
tests can check they travel through the loop unchanged. Everything else is real: a sandbox service with
bubblewrap sandboxes, nats-server, the rollout and judge services' handlers and consume loops.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import string
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
import pytest
from nats.js import api as jsapi
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from proto import catalog, codec
from proto import sandbox as api
from proto.prompts import PromptTicket, Sampling
from proto.trajectories import ScoredTrajectory
from services.lib.engine.base import EngineStats, GenerationResult, SamplingParams
from services.lib.sandbox_client import SandboxClient
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection
from services.runtime.service import ServiceContext
from services.sandbox.config import SandboxConfig
from services.sandbox.service import SandboxService, SandboxUnavailableError
from services.tasks.base import Prompt
from services.tasks.coding import SYSTEM_PROMPT

RUN = "agentic"
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


#: ChatML with tools in a system block and tool results as <tool_response> blocks in one user turn (as Qwen)
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response id=\"{{ m.tool_call_id }}\">\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(template: str = CHATML, specials: Sequence[str] = SPECIALS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII with ChatML ``specials`` and ``template`` as its chat
    template."""
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate([*specials, *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.add_special_tokens(list(specials))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>")
    tok.chat_template = template
    return tok


Hook = Callable[[int, str], Awaitable[None]]


class ScriptedEngine:
    """A stand-in Engine: reply ``k`` of ``script`` to a conversation that has ``k`` assistant turns so far
    (the rest of it when the context already ends with its beginning: a continued message).

    Stop strings are honoured like a real engine (tokens up to and including the stop string, text cut
    before it); a reply without one ends with EOS. Logprob of token ``j`` of turn ``k`` is ``-(k + 1) / 10``
    and every token carries :attr:`version`. ``hook(turn, context_text)`` runs before each reply.
    """

    def __init__(self, tokenizer: Any, script: Sequence[str], hook: Hook | None = None, version: int = 0) -> None:
        self.tokenizer = tokenizer
        self.script = list(script)
        self.hook = hook
        self._version = version
        self.calls: list[int] = []
        self.generated = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    @property
    def version(self) -> int:
        return self._version

    async def update_weights(self, state_dict: Any, version: int) -> None:
        self._version = version

    def stats(self) -> EngineStats:
        return EngineStats(pending=0, running=0, tokens_per_s=0.0, total_generated_tokens=self.generated,
                           version=self._version)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        context = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turn = context.count("<|im_start|>assistant") - 1
        self.calls.append(turn)
        if self.hook is not None:
            await self.hook(turn, context)
        reply = self.script[turn] if turn < len(self.script) else "Nothing more to do."
        written = context.rsplit("<|im_start|>assistant\n", 1)[-1]
        if written and reply.startswith(written):  # a continuation of this turn's message
            reply = reply[len(written):]
        finish = "eos"
        text = reply
        for stop in params.stop:
            at = reply.find(stop)
            if at >= 0:
                reply, text, finish = reply[: at + len(stop)], reply[:at], "stop"
                break
        ids = list(self.tokenizer.encode(reply, add_special_tokens=False))
        if finish == "eos":
            ids.append(self.tokenizer.eos_token_id)
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.generated += len(ids)
        await asyncio.sleep(0)  # a real engine yields to the event loop while it decodes
        return GenerationResult(token_ids=ids, logprobs=[-(turn + 1) / 10] * len(ids),
                                versions=[self._version] * len(ids), finish_reason=finish, text=text)


def coding_prompt(function: str = "add_2", tests: Sequence[tuple[list[Any], Any]] = (([1], 3), ([5], 7), ([-2], 0)),
                  question: str = "Write a Python function `add_2(x)` that returns x plus 2.") -> Prompt:
    """A prompt of the coding task with chosen hidden tests."""
    return Prompt(id=f"coding/test/{function}", text=question,
                  messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                  metadata={"function": function, "tests": json.dumps([[a, e] for a, e in tests])})


def ticket_for(task: Any, tokenizer: Any, prompt: Prompt, group_id: str, group_size: int,
               max_new_tokens: int = 200) -> PromptTicket:
    t = PromptTicket(run_id=RUN, task=task.name, group_id=group_id, prompt_id=prompt.id,
                     prompt_ids=task.format_prompt(tokenizer, prompt), prompt_text=prompt.text,
                     group_size=group_size, policy_version=0, sampling=Sampling(max_new_tokens=max_new_tokens),
                     metadata=dict(prompt.metadata))
    t.msg_id = f"{RUN}-{group_id}"
    return t


def loaded(url: str, service: Any) -> Loaded:
    return Loaded(run=RunSection(id=RUN), nats=NatsSection(url=url), common=CommonSection(drain_timeout_s=5.0),
                  service=service)


class Bus:
    """A sandbox service in this event loop plus a client connection; services started with :meth:`serve`."""

    def __init__(self, url: str, **sandbox_options: Any) -> None:
        self.url = url
        self.sandbox_options = sandbox_options  # more SandboxConfig fields of the sandbox service
        self.root = f"/var/tmp/rlbus-agentic-{uuid.uuid4().hex[:8]}"
        self.tasks: list[tuple[ServiceContext, asyncio.Task[Any]]] = []

    async def __aenter__(self) -> Bus:
        os.makedirs(self.root, mode=0o711)
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await bus.provision_all(self.js)
        self.sandboxes = SandboxClient(self.nc, RUN, timeout_s=30.0)
        sbx_loaded = loaded(self.url, SandboxConfig(root_dir=self.root, **self.sandbox_options))
        ctx = await self.context("sandbox", sbx_loaded)
        service = SandboxService.from_loaded(sbx_loaded)
        task = asyncio.create_task(service.run(ctx), name="agentic-sandbox-service")
        ready = asyncio.create_task(self.sandboxes.wait_ready(1), name="agentic-sandbox-ready")
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            ready.cancel()
            await self.close()
            if isinstance(task.exception(), SandboxUnavailableError):
                pytest.skip(f"bwrap sandboxes unavailable here: {task.exception()}")
            task.result()
        await ready
        self.tasks.append((ctx, task))
        return self

    async def context(self, name: str, cfg: Loaded) -> ServiceContext:
        return ServiceContext(name, f"test-{name}-{len(self.tasks)}", cfg, await nats.connect(self.url))

    def serve(self, ctx: ServiceContext, run: Awaitable[Any]) -> None:
        self.tasks.append((ctx, asyncio.create_task(run, name=f"agentic-{ctx.name}")))

    async def close(self) -> None:
        for ctx, task in reversed(self.tasks):
            ctx.stop.set()
            await asyncio.wait_for(task, 30)
            await ctx.nc.close()
        self.tasks.clear()
        await self.nc.close()
        shutil.rmtree(self.root, ignore_errors=True)

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish_ticket(self, ticket: PromptTicket) -> None:
        await bus.publish(self.js, f"rlbus.{RUN}.prompts", ticket)

    async def trajectories(self, count: int, timeout: float = 60.0) -> list[ScoredTrajectory]:
        """The first ``count`` scored trajectories of the run (ordered consumer over TRAJECTORIES)."""
        sub = await self.js.subscribe(f"rlbus.{RUN}.trajectories", stream=catalog.TRAJECTORIES_STREAM.name,
                                      ordered_consumer=True,
                                      config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL))
        try:
            out: list[ScoredTrajectory] = []
            while len(out) < count:  # a message carries a group's trajectories
                msg = codec.decode((await sub.next_msg(timeout=timeout)).data, catalog.TRAJECTORIES.msg_type)
                out.extend(catalog.members(msg))
            return out[:count]
        finally:
            await sub.unsubscribe()

    async def events(self, sandbox_id: str, until: str = "destroyed", timeout: float = 30.0) -> list[api.SandboxEvent]:
        """One sandbox's stored lifecycle events, up to the first of kind ``until``."""
        sub = await self.js.subscribe(catalog.SANDBOX_EVENTS.subject(RUN, sandbox_id), ordered_consumer=True)
        out: list[api.SandboxEvent] = []
        try:
            while not out or out[-1].kind != until:
                out.append(codec.decode((await sub.next_msg(timeout=timeout)).data, api.SandboxEvent))
        finally:
            await sub.unsubscribe()
        return out

    async def state(self, sandbox_id: str) -> str | None:
        """``running``/``paused``, or None once the sandbox is gone."""
        for info in await self.sandboxes.sandboxes(expected=1):
            if info.sandbox_id == sandbox_id:
                return info.state
        return None


async def all_events(js: Any) -> dict[str, list[api.SandboxEvent]]:
    """Every stored sandbox event of the run, by sandbox id (in order)."""
    from services.launcher.accounting import read_all

    events = await read_all(js, "SANDBOX_EVENTS", f"rlbus.{RUN}.sandbox.events.>", api.SandboxEvent, idle_s=1.0)
    out: dict[str, list[api.SandboxEvent]] = {}
    for e in events:
        out.setdefault(e.sandbox_id, []).append(e)
    return out
