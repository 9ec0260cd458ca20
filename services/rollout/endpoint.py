"""The rollout's OpenAI- and Anthropic-compatible HTTP endpoint, served beside its engine (aiohttp).

Black-box agents (any harness with an OpenAI or Anthropic client) run against the rollout's own engine: set
``base_url`` to ``http://<host>:<port>/v1`` (Anthropic: without ``/v1``) and the API key to the episode's
session id (or put the id in the path: ``/s/<session>/v1/...``). Routes: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``POST /v1/messages``.

**One engine.** Every request goes to the engine the rollout's native episodes use (``Engine.generate``),
which batches all of them step by step, so a slow client holds nothing but its own request; ``n`` choices
are ``n`` concurrent requests. An overloaded engine is waited out (as the episode loop does).

**Token-exact.** Prompts are rendered with the model's chat template and encoded once per segment; a call
that continues the previous one is the previous ids + the generated ids + the new messages' ids
(:mod:`services.rollout.chat_render`); what is recorded per call is described in
:mod:`services.rollout.sessions`. Tool calls are read from the generated tokens (special tokens included)
by the rollout's configured parser (``agent.tool_parser``) and returned as ``tool_calls``/``tool_use``.
Note that the torch engine prefills every request whole (it keeps no KV cache between requests); vLLM's
prefix caching reuses the shared prefix of a continuing call.

**Streaming** (``stream: true``) sends the role chunk (Anthropic: ``message_start``) at once and the
content when the generation finishes: the engine protocol returns whole completions, not tokens. A client
that disconnects cancels its generation (the engine drops the request) and the call is recorded as aborted.

**Errors** use each API's shape and status: a body that is not JSON, a field out of range or a refused
feature → 400 naming it; no or an unknown session → 401; a prompt longer than the model's context → 400
``context_length_exceeded``; an unknown route → 404; a body over ``max_request_bytes`` → 413.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.lib.engine.base import (
    Engine,
    EngineError,
    EngineOverloadedError,
    GenerationResult,
    InvalidRequestError,
    SamplingParams,
)
from services.rollout import anthropic_api, openai_api
from services.rollout.chat_render import ChatRenderer, RenderError, message_key, tools_key
from services.rollout.config import EndpointSection
from services.rollout.openai_api import ApiError, ChoiceResult, GenerationRequest
from services.rollout.sessions import (
    Call,
    Choice,
    Session,
    SessionBudgetError,
    SessionStore,
    UnknownSessionError,
)
from services.runtime import tracing
from services.tasks.toolcalls import get_parser

log = logging.getLogger("rlbus.rollout.endpoint")


def advertised_host(host: str) -> str:
    """The address to give agents for an endpoint listening on ``host``: ``host`` itself, or for a wildcard
    (0.0.0.0, ::, "") this host's address on its default route (a UDP socket is connected, nothing is sent),
    else its name's address; 127.0.0.1 when it has none."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
            return str(s.getsockname()[0])
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ChatContext:
    """What a chat call's continuation must start with: its messages and its tools (and the messages as the
    template rendered them, with the generation prompt, so that a continuation need not render them again)."""

    def __init__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.keys = [message_key(m) for m in messages]
        self.tools = tools
        self.tools_key = tools_key(tools)
        self.rendered: str | None = None


class Endpoint:
    """The HTTP server over ``engine``; :attr:`sessions` holds the sessions its clients call with."""

    def __init__(self, engine: Engine, tokenizer: Any, cfg: EndpointSection, model_name: str,
                 tool_parser: str = "hermes") -> None:
        self.engine = engine
        self.cfg = cfg
        self.model_name = cfg.served_model or model_name
        self.renderer = ChatRenderer(tokenizer)
        self.parser = get_parser(tool_parser)
        self.sessions = SessionStore(cfg.max_sessions)
        self.counters = {"requests": 0, "errors": 0, "aborted": 0}
        self.port = 0
        self.agent_host = cfg.agent_host or cfg.host
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self._errors])
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/v1/messages", self._messages)
            app.router.add_get(prefix + "/v1/models", self._models)
        # a client that goes away cancels its handler, and with it its engine request
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.agent_host = self.cfg.agent_host or advertised_host(self.cfg.host)
        log.info("endpoint serving %s on http://%s:%d/v1 (agents call %s)", self.model_name, self.cfg.host,
                 self.port, self.base_url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL agents are given (Anthropic clients take it without ``/v1``)."""
        host = f"[{self.agent_host}]" if ":" in self.agent_host else self.agent_host
        return f"http://{host}:{self.port}/v1"

    # ---------------------------------------------------------------- plumbing
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every error in the shape of the API the route belongs to."""
        anthropic = request.path.endswith("/v1/messages")
        try:
            return await handler(request)
        except ApiError as e:
            error = e
        except web.HTTPRequestEntityTooLarge as e:
            error = ApiError(413, f"the request body is larger than {self.cfg.max_request_bytes} bytes "
                                  f"(max_request_bytes): {e.text}", code="request_too_large")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error = ApiError(e.status, f"{request.method} {request.path}: {e.reason}",
                             kind="not_found_error" if e.status == 404 else "invalid_request_error")
        except EngineError as e:  # the engine stopped or died under the request: the client may retry elsewhere
            error = ApiError(503, f"the engine cannot serve the request: {e}", kind="server_error",
                             code="engine_unavailable")
        except Exception as e:  # a bug of the endpoint: said in the API's shape, and logged with its trace
            log.exception("endpoint request %s %s failed", request.method, request.path)
            error = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        self.counters["errors"] += 1
        body = anthropic_api.error_body(error) if anthropic else openai_api.error_body(error)
        return web.json_response(body, status=error.status)

    def _session(self, request: web.Request) -> Session:
        sid = request.match_info.get("session") or request.headers.get("x-api-key", "")
        if not sid:
            auth = request.headers.get("Authorization", "")
            sid = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not sid:
            raise ApiError(401, "no session: set the API key (or the /s/<session> path) to the episode's session id",
                           kind="authentication_error", code="invalid_api_key")
        try:
            return self.sessions.get(sid)
        except UnknownSessionError:
            raise ApiError(401, f"unknown session {sid[:64]!r}: it was never opened or is already closed",
                           kind="authentication_error", code="invalid_api_key") from None

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    # ---------------------------------------------------------------- routes
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlbus"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = openai_api.parse_chat(await self._body(request), self.cfg.max_n)
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if not req.stream:
            call, results = await self.generate(session, req)
            pairs = self._messages_of(call, results)
            return web.json_response(openai_api.chat_response(rid, self.model_name, created, pairs, req,
                                                              len(call.prompt_ids)))
        stream: web.StreamResponse | None = None

        async def started(prompt_tokens: int) -> None:  # the request checked: the stream opens
            nonlocal stream
            stream = await self._open_stream(request)
            await _sse(stream, openai_api.first_chunk(rid, self.model_name, created, req.n))

        try:
            call, results = await self.generate(session, req, started)
        except ApiError as e:
            if stream is None:
                raise
            await _sse(stream, openai_api.error_body(e))
            return stream
        assert stream is not None
        for chunk in openai_api.chat_chunks(rid, self.model_name, created, self._messages_of(call, results), req,
                                            len(call.prompt_ids)):
            await _sse(stream, chunk)
        await stream.write(b"data: [DONE]\n\n")
        return stream

    async def _completions(self, request: web.Request) -> web.Response:
        session = self._session(request)
        req = openai_api.parse_completion(await self._body(request), self.cfg.max_n)
        _need_no_stream(req)
        call, results = await self.generate(session, req)
        return web.json_response(openai_api.completion_response(
            f"cmpl-{secrets.token_hex(12)}", self.model_name, int(time.time()), results, req, len(call.prompt_ids)))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = anthropic_api.parse_messages(await self._body(request))
        rid = f"msg_{secrets.token_hex(12)}"
        if not req.stream:
            call, results = await self.generate(session, req)
            [(c, message)] = self._messages_of(call, results)
            return web.json_response(anthropic_api.message_response(rid, self.model_name, c, message,
                                                                    len(call.prompt_ids)))
        stream: web.StreamResponse | None = None

        async def started(prompt_tokens: int) -> None:  # the request checked: the stream opens
            nonlocal stream
            stream = await self._open_stream(request)
            await _event(stream, *anthropic_api.start_event(rid, self.model_name, prompt_tokens))

        try:
            call, results = await self.generate(session, req, started)
        except ApiError as e:
            if stream is None:
                raise
            await _event(stream, "error", anthropic_api.error_body(e))
            return stream
        assert stream is not None
        [(c, message)] = self._messages_of(call, results)
        for name, data in anthropic_api.stream_events(c, message):
            await _event(stream, name, data)
        return stream

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        return stream

    def _messages_of(self, call: Call, results: list[ChoiceResult]) -> list[tuple[ChoiceResult, dict[str, Any]]]:
        return [(c, openai_api.assistant_message(c, f"call_{call.index}_{i}")) for i, c in enumerate(results)]

    # ---------------------------------------------------------------- generation
    async def generate(self, session: Session, req: GenerationRequest,
                       started: Callable[[int], Awaitable[None]] | None = None) -> tuple[Call, list[ChoiceResult]]:
        """Render, record and generate one call of ``session``; ``started(prompt_tokens)`` runs once the prompt
        is known. Raises :class:`ApiError` for what the client must fix."""
        self.counters["requests"] += 1
        prompt_ids, context, continues = self._prompt(session, req)
        params = self._params(req, len(prompt_ids))
        params = self._budget(session, params, prompt_ids, continues)
        call = session.begin(prompt_ids, context, continues)
        try:
            if started is not None:
                await started(len(prompt_ids))
            with tracing.span("endpoint call", call=call.index, segment=call.segment, n=req.n,
                              prompt_tokens=len(prompt_ids), new_tokens=call.new_tokens, **session.labels):
                results = await asyncio.gather(*(self._generate(prompt_ids, params, i) for i in range(req.n)))
        except asyncio.CancelledError:
            self.counters["aborted"] += 1
            session.abort(call, "the client went away")
            raise
        except InvalidRequestError as e:
            session.abort(call, f"the engine refused it: {e}")
            raise ApiError(400, f"the engine refused the request: {e}") from e
        except Exception as e:
            session.abort(call, f"the engine failed: {e}")
            raise
        choices = [self._choice(r, req) for r in results]
        messages = self._messages_of(call, choices)
        session.finish(call, [Choice(token_ids=r.token_ids, logprobs=r.logprobs, versions=r.versions,
                                     finish_reason=r.finish_reason,
                                     key=message_key(m) if req.messages is not None else c.text)
                              for r, (c, m) in zip(results, messages, strict=True)])
        return call, choices

    def _budget(self, session: Session, params: SamplingParams, prompt_ids: list[int],
                continues: tuple[Call, int] | None) -> SamplingParams:
        """``params`` with max_new_tokens capped by the session's token budget; a call past a budget is refused."""
        try:
            left = session.tokens_left()
        except SessionBudgetError as e:
            raise ApiError(400, str(e), code="session_budget_exhausted") from e
        if left is None:
            return params
        if continues is not None:  # the new prompt tokens count against the budget too
            prev, j = continues
            left -= len(prompt_ids) - len(prev.prompt_ids) - len(prev.choices[j].token_ids)
        elif session.calls:
            left -= len(prompt_ids)
        if left <= 0:
            session.exhausted = session.exhausted or "token_budget"
            raise ApiError(400, f"the session's budget of {session.max_tokens} tokens is spent by this prompt",
                           code="session_budget_exhausted")
        return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, left))

    def _prompt(self, session: Session, req: GenerationRequest) -> tuple[list[int], Any, tuple[Call, int] | None]:
        """The call's prompt ids, its context, and the (call, choice) it continues, if it does."""
        if req.messages is None:
            return self._completion_prompt(session, req.prompt)
        context = ChatContext(req.messages, req.tools)
        for prev in session.tips():
            before = prev.context
            if not isinstance(before, ChatContext) or before.tools_key != context.tools_key:
                continue
            k = len(before.keys)
            if len(context.keys) <= k or context.keys[:k] != before.keys:
                continue
            for j, choice in enumerate(prev.choices):
                if context.keys[k] != choice.key:
                    continue
                try:
                    cont = self.renderer.continuation(before.messages, req.messages, req.tools or None,
                                                      choice.token_ids, before.rendered)
                except RenderError as e:
                    raise ApiError(400, str(e), param="messages") from e
                if cont is not None:
                    suffix, context.rendered = cont
                    return prev.prompt_ids + choice.token_ids + suffix, context, (prev, j)
        try:
            ids, context.rendered = self.renderer.prompt(req.messages, req.tools or None)
        except RenderError as e:
            raise ApiError(400, str(e), param="messages") from e
        return ids, context, None

    def _completion_prompt(self, session: Session, prompt: str | list[int] | None
                           ) -> tuple[list[int], Any, tuple[Call, int] | None]:
        for prev in session.tips():
            for j, choice in enumerate(prev.choices):
                if isinstance(prompt, list):
                    head = prev.prompt_ids + choice.token_ids
                    if prompt[:len(head)] == head:
                        return list(prompt), tuple(prompt), (prev, j)
                elif isinstance(prev.context, str) and isinstance(choice.key, str):
                    head_text = prev.context + choice.key
                    if prompt.startswith(head_text):
                        ids = prev.prompt_ids + choice.token_ids + self.renderer.encode(prompt[len(head_text):])
                        return ids, prompt, (prev, j)
        if isinstance(prompt, list):
            return list(prompt), tuple(prompt), None
        return self.renderer.encode(prompt or ""), prompt, None

    def _params(self, req: GenerationRequest, prompt_len: int) -> SamplingParams:
        context = getattr(self.engine, "max_positions", None)  # an optional capability of engines
        max_tokens = req.max_tokens or self.cfg.default_max_tokens
        if context is not None:
            if prompt_len >= context:
                raise ApiError(400, f"the prompt has {prompt_len} tokens; the model's context is {context} tokens",
                               param="messages", code="context_length_exceeded")
            if req.max_tokens is not None and prompt_len + max_tokens > context:
                raise ApiError(400, f"the prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                               f"model's context of {context} tokens", param="max_tokens",
                               code="context_length_exceeded")
            max_tokens = min(max_tokens, context - prompt_len)
        stops = list(dict.fromkeys([*req.stop, *(self.parser.stop if req.parse_tools else ())]))
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=stops,
                                  seed=req.seed)
        except InvalidRequestError as e:
            raise ApiError(400, str(e)) from e

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, index: int) -> GenerationResult:
        if params.seed is not None and index:
            params = dataclasses.replace(params, seed=params.seed + index)  # n distinct choices
        delay = 0.05
        while True:
            try:
                return await self.engine.generate(prompt_ids, params)
            except EngineOverloadedError:
                await asyncio.sleep(delay)  # back-pressure from the engine queue; the client may give up
                delay = min(2 * delay, 2.0)

    def _choice(self, r: GenerationResult, req: GenerationRequest) -> ChoiceResult:
        pieces = [self.renderer.decode([t], special=True) for t in r.token_ids] if req.logprobs else []
        text, calls = r.text, []
        if req.parse_tools:
            raw = self.renderer.decode(r.token_ids, special=True)
            eos = self.renderer.eos_text
            raw = raw[:-len(eos)] if eos and raw.endswith(eos) else raw
            parsed = self.parser.parse(raw, [t["function"]["name"] for t in req.tools])
            if parsed.calls and not parsed.errors:
                text, calls = parsed.content, list(parsed.calls)
        stop_string = next((s for s in req.stop if r.finish_reason == "stop" and
                            self.renderer.decode(r.token_ids, special=True).endswith(s)), None)
        finish = "tool_calls" if calls else ("length" if r.finish_reason == "length" else "stop")
        return ChoiceResult(text=text, tool_calls=calls, finish_reason=finish, token_ids=r.token_ids,
                            logprobs=r.logprobs, pieces=pieces, stop_string=stop_string)


def _need_no_stream(req: GenerationRequest) -> None:
    if req.stream:
        raise ApiError(400, "stream is supported on /v1/chat/completions and /v1/messages, not on /v1/completions",
                       param="stream", code="unsupported")


async def _sse(stream: web.StreamResponse, data: dict[str, Any]) -> None:
    await stream.write(f"data: {json.dumps(data)}\n\n".encode())


async def _event(stream: web.StreamResponse, name: str, data: dict[str, Any]) -> None:
    await stream.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
