"""OpenAI's wire format for the endpoint: requests checked and normalised, responses, stream chunks, errors.

Both APIs (this one and :mod:`services.rollout.anthropic_api`) become one :class:`GenerationRequest`; the
endpoint generates, and each API words the result (:class:`ChoiceResult`) in its own shape.

**Supported** (chat completions): ``messages`` (``system``/``developer``/``user``/``assistant``/``tool``;
content as a string or text parts), ``tools`` (functions), ``tool_choice`` ``auto``/``none``, ``temperature``,
``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop``, ``n``, ``seed``, ``logprobs`` (the sampled
token's), ``stream`` with ``stream_options.include_usage``. Completions: one ``prompt`` (text or token
ids), the same sampling fields, ``logprobs`` (an integer: the sampled token's only).
**Refused with a 400 naming the field**: ``tool_choice`` ``required`` or a named function, ``top_logprobs``
above 0, ``logit_bias``, ``response_format`` other than text, non-zero presence/frequency penalties,
``functions``/``function_call``, audio and image content, ``echo``, ``suffix``, ``best_of`` above ``n``,
several prompts in one completions request. Anything else a client sends is ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from services.tasks.toolcall_base import ToolCall

ROLES = {"system", "user", "assistant", "tool", "developer"}


class ApiError(Exception):
    """A request the endpoint answers with an error: HTTP ``status``, a message naming the problem."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(e: ApiError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


@dataclass
class GenerationRequest:
    """What the endpoint generates for, whichever API asked."""

    model: str = ""
    #: chat: normalised messages (role, content as a string, tool_calls with dict arguments, tool_call_id)
    messages: list[dict[str, Any]] | None = None
    #: completions: the prompt as text or token ids
    prompt: str | list[int] | None = None
    #: function tools in OpenAI's shape ({"type": "function", "function": {...}})
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: read tool calls out of the output (false for tool_choice "none" and completions)
    parse_tools: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChoiceResult:
    """One generated choice as both APIs word it."""

    text: str
    tool_calls: list[ToolCall]
    #: "stop", "length" or "tool_calls"
    finish_reason: str
    token_ids: list[int]
    logprobs: list[float]
    #: the text of each token (for logprobs)
    pieces: list[str]
    #: the stop string that ended it, if one did
    stop_string: str | None = None


def _need(cond: bool, message: str, param: str, code: str | None = None) -> None:
    if not cond:
        raise ApiError(400, message, param=param, code=code)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    _need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          f"{key} must be a number, got {value!r}", key)
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    _need(ok, f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    _need(isinstance(value, int) and not isinstance(value, bool), f"{key} must be an integer, got {value!r}", key)
    _need(value >= lo and (hi is None or value <= hi),
          f"{key} must be {'at least ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}, got {value}", key)
    return value


def _sampling(body: dict[str, Any], req: GenerationRequest, max_n: int) -> None:
    """The sampling fields both OpenAI routes share, checked; the refused features named."""
    req.model = str(body.get("model") or "")
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    n = _integer(body, "n", 1)
    req.n = 1 if n is None else n
    _need(req.n <= max_n, f"n = {req.n} is above this endpoint's limit of {max_n} choices per request", "n",
          "n_above_limit")
    req.seed = _integer(body, "seed", -(2 ** 63), 2 ** 63 - 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    _need(stop is None or (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)),
          "stop must be a non-empty string or a list of them", "stop")
    req.stop = list(stop or [])
    req.stream = bool(body.get("stream") or False)
    options = body.get("stream_options") or {}
    _need(isinstance(options, dict), "stream_options must be an object", "stream_options")
    req.include_usage = bool(options.get("include_usage"))
    for key in ("presence_penalty", "frequency_penalty"):
        _need(not body.get(key), f"{key} is not supported by this endpoint (only 0)", key, "unsupported")
    _need(not body.get("logit_bias"), "logit_bias is not supported by this endpoint", "logit_bias", "unsupported")


def parse_chat(body: Any, max_n: int) -> GenerationRequest:
    """A ``/v1/chat/completions`` body, checked and normalised."""
    _need(isinstance(body, dict), "the request body must be a JSON object", "body")
    req = GenerationRequest()
    _sampling(body, req, max_n)
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    req.max_tokens = _integer({"max_tokens": limit}, "max_tokens", 1)
    raw = body.get("messages")
    _need(isinstance(raw, list) and bool(raw), "messages must be a non-empty list", "messages")
    req.messages = [_message(m, i) for i, m in enumerate(raw)]
    for key in ("functions", "function_call", "audio"):
        _need(body.get(key) is None, f"{key} is not supported by this endpoint (use tools)", key, "unsupported")
    modalities = body.get("modalities")
    _need(modalities in (None, ["text"]), "only text output is supported", "modalities", "unsupported")
    fmt = body.get("response_format")
    _need(fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"),
          "response_format is not supported by this endpoint (no constrained decoding)", "response_format",
          "unsupported")
    _need(not body.get("top_logprobs"), "top_logprobs is not supported: the engine records the sampled token's "
          "logprob only (logprobs = true)", "top_logprobs", "unsupported")
    req.logprobs = bool(body.get("logprobs") or False)
    req.tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    _need(choice in (None, "auto", "none"), f"tool_choice {choice!r} is not supported (no constrained decoding): "
          "use \"auto\" or \"none\"", "tool_choice", "unsupported")
    req.parse_tools = bool(req.tools) and choice != "none"
    return req


def parse_completion(body: Any, max_n: int) -> GenerationRequest:
    """A ``/v1/completions`` body, checked."""
    _need(isinstance(body, dict), "the request body must be a JSON object", "body")
    req = GenerationRequest(parse_tools=False)
    _sampling(body, req, max_n)
    req.max_tokens = _integer(body, "max_tokens", 1)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in prompt)
    _need((isinstance(prompt, str) and bool(prompt)) or is_ids,
          "prompt must be one non-empty string or one list of token ids (one prompt per request)", "prompt")
    req.prompt = prompt
    _need(not body.get("echo"), "echo is not supported by this endpoint", "echo", "unsupported")
    _need(not body.get("suffix"), "suffix is not supported by this endpoint", "suffix", "unsupported")
    best_of = body.get("best_of")
    _need(best_of in (None, req.n), "best_of other than n is not supported", "best_of", "unsupported")
    logprobs = _integer(body, "logprobs", 0, 1)
    req.logprobs = logprobs is not None
    return req


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    _need(isinstance(content, list), f"{where}.content must be a string or a list of text parts", where)
    parts = []
    for part in content:
        _need(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str),
              f"{where}.content: only text parts are supported, got {json.dumps(part)[:80]}", where, "unsupported")
        parts.append(part["text"])
    return "".join(parts)


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    _need(isinstance(m, dict) and m.get("role") in ROLES,
          f"{where} must be an object whose role is one of {', '.join(sorted(ROLES))}", where)
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id") or "")
        if m.get("name"):
            out["name"] = str(m["name"])
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    _need(isinstance(fn, dict) and isinstance(fn.get("name"), str), f"{where} needs function.name", where)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments is not JSON", param=where) from None
    _need(isinstance(args, dict), f"{where}.function.arguments must be a JSON object", where)
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not tools:
        return []
    _need(isinstance(tools, list), "tools must be a list", "tools")
    out = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        _need(isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"]),
              f"tools[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", f"tools[{j}]")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if k in fn}})
    return out


# --- responses -------------------------------------------------------------------------------------------


def assistant_message(c: ChoiceResult, call_prefix: str) -> dict[str, Any]:
    """The choice as a chat message (tool call ids ``<prefix>_<i>``), normalised as a request's would be."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message["tool_calls"] = [{"id": f"{call_prefix}_{i}", "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}}
                                 for i, t in enumerate(c.tool_calls)]
    return message


def _wire_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": t["id"], "type": "function",
             "function": {"name": t["function"]["name"], "arguments": json.dumps(t["function"]["arguments"])}}
            for t in message.get("tool_calls", [])]


def _chat_logprobs(c: ChoiceResult) -> dict[str, Any]:
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(c.pieces, c.logprobs, strict=True)], "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, created: int, choices: list[tuple[ChoiceResult, dict[str, Any]]],
                  req: GenerationRequest, prompt_tokens: int) -> dict[str, Any]:
    out = []
    for i, (c, message) in enumerate(choices):
        wire: dict[str, Any] = {"role": "assistant", "content": c.text or (None if c.tool_calls else "")}
        if c.tool_calls:
            wire["tool_calls"] = _wire_calls(message)
        out.append({"index": i, "message": wire, "finish_reason": c.finish_reason,
                    "logprobs": _chat_logprobs(c) if req.logprobs else None})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c, _ in choices))}


def chat_chunks(rid: str, model: str, created: int, choices: list[tuple[ChoiceResult, dict[str, Any]]],
                req: GenerationRequest, prompt_tokens: int) -> list[dict[str, Any]]:
    """The stream's chunks after the first (each choice's content, tool calls and finish; then the usage)."""
    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    chunks = []
    for i, (c, message) in enumerate(choices):
        if c.text:
            chunks.append(chunk(i, {"content": c.text}, logprobs=_chat_logprobs(c) if req.logprobs else None))
        for k, call in enumerate(_wire_calls(message)):
            chunks.append(chunk(i, {"tool_calls": [{"index": k, **call}]}))
        chunks.append(chunk(i, {}, c.finish_reason))
    if req.include_usage:
        chunks.append({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(len(c.token_ids) for c, _ in choices))})
    return chunks


def first_chunk(rid: str, model: str, created: int, n: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None} for i in range(n)]}


def completion_response(rid: str, model: str, created: int, choices: list[ChoiceResult], req: GenerationRequest,
                        prompt_tokens: int, obj: str = "text_completion") -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if req.logprobs:
            offsets, at = [], 0
            for p in c.pieces:
                offsets.append(at)
                at += len(p)
            logprobs = {"tokens": c.pieces, "token_logprobs": c.logprobs, "top_logprobs": None,
                        "text_offset": offsets}
        out.append({"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": logprobs})
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": out,
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}
