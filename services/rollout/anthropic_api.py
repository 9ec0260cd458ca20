"""Anthropic's Messages API for the endpoint: a ``/v1/messages`` body as a :class:`GenerationRequest`, the
result as a message or its stream events, errors in Anthropic's shape.

**Supported**: ``system`` (a string or text blocks), ``messages`` with text, ``tool_use`` and ``tool_result``
blocks, ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` ``auto``/``none``,
``max_tokens`` (required, as Anthropic requires it), ``temperature``, ``top_p``, ``stop_sequences``,
``stream``. **Refused with a 400**: ``tool_choice`` ``any``/``tool`` (no constrained decoding), ``top_k``,
image and document blocks, ``thinking``. One choice per request (the API has no ``n``).
"""

from __future__ import annotations

import json
from typing import Any

from services.rollout.openai_api import ApiError, ChoiceResult, GenerationRequest, _need, _number

#: Anthropic's error type per HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def parse_messages(body: Any) -> GenerationRequest:
    """A ``/v1/messages`` body, checked and turned into chat messages (tool_use → tool_calls, tool_result →
    ``tool`` messages)."""
    _need(isinstance(body, dict), "the request body must be a JSON object", "body")
    req = GenerationRequest(model=str(body.get("model") or ""))
    limit = body.get("max_tokens")
    _need(isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1,
          f"max_tokens is required: an integer >= 1, got {limit!r}", "max_tokens")
    req.max_tokens = limit
    req.temperature = _number(body, "temperature", 1.0, 0.0, 1.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    stops = body.get("stop_sequences") or []
    _need(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
          "stop_sequences must be a list of non-empty strings", "stop_sequences")
    req.stop = list(stops)
    req.stream = bool(body.get("stream") or False)
    _need(body.get("top_k") is None, "top_k is not supported by this endpoint", "top_k")
    _need(not body.get("thinking"), "thinking is not supported by this endpoint", "thinking")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _blocks_text(system, "system")})
    raw = body.get("messages")
    _need(isinstance(raw, list) and bool(raw), "messages must be a non-empty list", "messages")
    for i, m in enumerate(raw):
        messages += _message(m, f"messages[{i}]")
    req.messages = messages
    req.tools = _tools(body.get("tools"))
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    _need(kind in ("auto", "none"), f"tool_choice {choice!r} is not supported (no constrained decoding): use "
          "{\"type\": \"auto\"} or {\"type\": \"none\"}", "tool_choice")
    req.parse_tools = bool(req.tools) and kind == "auto"
    return req


def _blocks_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    _need(isinstance(content, list), f"{where} must be a string or a list of blocks", where)
    texts = []
    for b in content:
        _need(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str),
              f"{where}: only text blocks are allowed here, got {json.dumps(b)[:80]}", where)
        texts.append(b["text"])
    return "".join(texts)


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    _need(isinstance(m, dict) and m.get("role") in ("user", "assistant"),
          f"{where} must be an object whose role is user or assistant", where)
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    _need(isinstance(content, list), f"{where}.content must be a string or a list of blocks", where)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use" and m["role"] == "assistant":
            _need(isinstance(b.get("input", {}), dict), f"{at}.input must be an object", at)
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": str(b.get("name", "")), "arguments": b.get("input") or {}}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": _blocks_text(b.get("content") or "", at)})
        else:
            raise ApiError(400, f"{at}: a {kind!r} block is not supported in a {m['role']} message", param=at)
    if m["role"] == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not tools:
        return []
    _need(isinstance(tools, list), "tools must be a list", "tools")
    out = []
    for j, t in enumerate(tools):
        _need(isinstance(t, dict) and isinstance(t.get("name"), str) and bool(t["name"]),
              f"tools[{j}] must be an object with a name (and input_schema)", f"tools[{j}]")
        fn = {"name": t["name"], "description": t.get("description", ""),
              "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    return out


def _stop_reason(c: ChoiceResult) -> tuple[str, str | None]:
    if c.tool_calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.stop_string is not None:
        return "stop_sequence", c.stop_string
    return "end_turn", None


def _blocks(c: ChoiceResult, message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": c.text}] if c.text or not c.tool_calls else []
    for t in message.get("tool_calls", []):
        blocks.append({"type": "tool_use", "id": t["id"], "name": t["function"]["name"],
                       "input": t["function"]["arguments"]})
    return blocks


def message_response(rid: str, model: str, c: ChoiceResult, message: dict[str, Any],
                     prompt_tokens: int) -> dict[str, Any]:
    reason, sequence = _stop_reason(c)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": _blocks(c, message),
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(c.token_ids)}}


def start_event(rid: str, model: str, prompt_tokens: int) -> tuple[str, dict[str, Any]]:
    return "message_start", {"type": "message_start", "message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}


def stream_events(c: ChoiceResult, message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events after ``message_start``: each block's start, delta and stop, the stop reason, the end."""
    events: list[tuple[str, dict[str, Any]]] = []
    for i, block in enumerate(_blocks(c, message)):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}),
                   ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
                   ("content_block_stop", {"type": "content_block_stop", "index": i})]
    reason, sequence = _stop_reason(c)
    events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": {"output_tokens": len(c.token_ids)}}),
               ("message_stop", {"type": "message_stop"})]
    return events
