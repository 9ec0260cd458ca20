"""Tool-call parsers: one per model family, chosen by name, all returning the same :class:`Parsed`.

Models fine-tuned for native tool calling each write calls in their own format, which their chat
template teaches them. The environment layer and the OpenAI-compatible endpoint need the calls as
``(name, arguments)`` whatever the family, and need a broken call as an *error they can show the
model*, not as an exception that ends the episode. So every parser here:

* returns :class:`Parsed` (``content``: the text outside calls, stripped; ``calls``; ``errors``);
* never raises on model output: bad JSON, a missing name or non-object arguments become an error
  string naming the problem and the character offset, with a short excerpt;
* reports a message cut inside a call (token limit) as an error, never as a call, and exposes the
  same check as :meth:`ToolCallParser.incomplete`;
* gives calls deterministic ids ``call_0``, ``call_1``, ... in message order (ids written by the
  model, e.g. Mistral's ``[CALL_ID]``, are ignored, so replays and tests are reproducible);
* with ``tools`` given, turns a call to a name outside it into an error naming the known tools.

**Formats** (:data:`PARSERS`; :func:`parser_for_model` guesses one from a model name or template):

* ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3): zero or more ``<tool_call>{json}</tool_call>`` blocks,
  the JSON ``{"name": ..., "arguments": {...}}`` (``"parameters"`` accepted too). Several blocks are
  parallel calls; the text outside them is the content::

      Let me look.<tool_call>{"name": "search", "arguments": {"q": "nats"}}</tool_call>

* ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): a message that starts with ``{`` or
  contains ``<|python_tag|>`` is a call message: one or more JSON objects ``{"name": ...,
  "parameters": {...}}`` (``"arguments"`` accepted too) separated by ``;``. Text before
  ``<|python_tag|>`` is content; a message starting with anything else is plain content::

      <|python_tag|>{"name": "search", "parameters": {"q": "nats"}}; {"name": "now", "parameters": {}}

* ``mistral`` (Mistral, Mixtral, Ministral, Devstral): text before the first ``[TOOL_CALLS]`` is
  content; after it either a JSON list ``[{"name": ..., "arguments": {...}}, ...]`` (a single object
  is accepted) or the newer ``name[ARGS]{json}`` form, repeated with ``[TOOL_CALLS]`` for parallel
  calls (an optional ``[CALL_ID]id`` after the name is skipped)::

      [TOOL_CALLS][{"name": "search", "arguments": {"q": "nats"}}]
      [TOOL_CALLS]search[ARGS]{"q": "nats"}[TOOL_CALLS]now[ARGS]{}

* ``markdown`` (any chat model; rlbus's own agent tasks): the code-block tools of
  :mod:`services.tasks.tools` through its ``parse_tool_call``, mapped onto the same interface:
  ``write`` → ``{"path", "content"}``, ``python`` → ``{"code"}``, ``bash`` → ``{"command"}``; a block
  in a language that is no tool is an error. At most one call per message (generation stops at
  :data:`services.tasks.tools.FENCE_STOP`), and the content is the text before its block::

      I will test it.
      ```bash
      python -m pytest -q
      ```

**Not supported**: Llama's built-in tools (``<|python_tag|>brave_search.call(query=...)`` or bare
Python after the tag: an error), Qwen3-Coder's XML ``<function=name>`` format, Mistral's pre-v3
formats other than the two above, DeepSeek/GLM/Kimi formats, and streaming (partial) parsing.
Arguments given as a JSON *string* holding an object (OpenAI wire style) are accepted; any other
non-object is an error. A missing ``arguments`` means ``{}`` (a tool without parameters).

**Stop strings**: none of the native families needs one (a call message ends with the template's
end-of-turn token, which the engine treats as EOS; stopping at ``</tool_call>`` would forbid parallel
calls); ``markdown`` stops at the closing fence.

**Bounded time** (a 10 kB message of broken JSON parses in about a millisecond): markers are found
with :meth:`str.find`, a call's JSON is decoded by the C decoder (``raw_decode``, which also says
where the value ends), and only a call that fails to decode is scanned again by :func:`json_end` to
tell a cut call from a malformed one and to find where it ends. That scan is one left-to-right pass
of one regex whose string branch is the unrolled ``"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"``: every character
can be consumed by one branch only, so a failing match gives back linear work at most, never
exponential. Every pass resumes where the last stopped, so a message is read a constant number
of times.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from services.tasks import tools as markdown_tools
from services.tasks.toolcall_base import (
    EXCERPT_CHARS,
    Parsed,
    ToolCall,
    ToolCallParser,
    UnknownParserError,
    _Collector,
    excerpt,
    json_end,
    read_json,
    skip_space,
)

_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")

__all__ = ["EXCERPT_CHARS", "PARSERS", "Parsed", "ToolCall", "ToolCallParser", "UnknownParserError", "get_parser",
           "json_end", "parse", "parser_for_model"]


# ---------------------------------------------------------------------------------------------------------
# hermes


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/3, Hermes)."""

    name = "hermes"
    stop: tuple[str, ...] = ()
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def parse(self, text: str, tools: Sequence[str] | None = None) -> Parsed:
        out = _Collector(tools)
        content: list[str] = []
        pos = 0
        while True:
            opening = text.find(self.OPEN, pos)
            if opening < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:opening])
            body = opening + len(self.OPEN)
            closing = text.find(self.CLOSE, body)
            if closing < 0:
                out.error(opening, f"cut off before {self.CLOSE} (the message ended inside the call): "
                                   f"{excerpt(text, opening)}")
                break
            start = skip_space(text, body)
            if start >= closing:
                out.error(opening, f"empty {self.OPEN} block")
            else:
                ok, obj = out.decode(text, start, start + len(text[start:closing].rstrip()))
                if ok:
                    out.add_object(start, obj, ("arguments", "parameters"))
            pos = closing + len(self.CLOSE)
        return out.result("".join(content))

    def incomplete(self, text: str) -> bool:
        return text.rfind(self.OPEN) > text.rfind(self.CLOSE)


# ---------------------------------------------------------------------------------------------------------
# llama3_json


class Llama3JsonParser:
    """``<|python_tag|>``-prefixed (or bare) JSON objects separated by ``;`` (Llama 3.x)."""

    name = "llama3_json"
    stop: tuple[str, ...] = ()
    TAG = "<|python_tag|>"

    def _start(self, text: str) -> int | None:
        """Where the calls begin, or None for a plain content message."""
        tag = text.find(self.TAG)
        if tag >= 0:
            return tag
        first = skip_space(text, 0)
        return first if text.startswith("{", first) else None

    def parse(self, text: str, tools: Sequence[str] | None = None) -> Parsed:
        out = _Collector(tools)
        start = self._start(text)
        if start is None:
            return out.result(text)
        content = text[:start]
        pos = start + len(self.TAG) if text.startswith(self.TAG, start) else start
        while True:
            pos = skip_space(text, pos)
            if pos >= len(text):
                if not out.calls and not out.errors:
                    out.error(pos, f"nothing after {self.TAG}")
                break
            if text[pos] != "{":
                out.error(pos, f"expected a JSON object {{\"name\": ..., \"parameters\": {{...}}}}, got "
                               f"{excerpt(text, pos)} (built-in tools such as brave_search are not supported)")
                break
            ok, obj, end = out.read(text, pos, "cut off inside the JSON object (it never closes)")
            if end is None:
                break
            if ok:
                out.add_object(pos, obj, ("parameters", "arguments"))
            pos = skip_space(text, end)
            if text.startswith(";", pos):
                pos += 1
            elif pos < len(text):
                out.error(pos, f"expected ';' or the end of the message after a call, got {excerpt(text, pos)}")
                break
        return out.result(content)

    def incomplete(self, text: str) -> bool:
        start = self._start(text)
        if start is None:
            return False
        pos = start + len(self.TAG) if text.startswith(self.TAG, start) else start
        while True:
            pos = skip_space(text, pos)
            if not text.startswith("{", pos):
                return False
            found = read_json(text, pos)
            if found is None:
                return True
            if isinstance(found, str):
                return False
            pos = skip_space(text, found[1])
            if not text.startswith(";", pos):
                return False
            pos += 1


# ---------------------------------------------------------------------------------------------------------
# mistral


class MistralParser:
    """``[TOOL_CALLS]`` + a JSON list, or ``[TOOL_CALLS]name[ARGS]{json}`` repeated (Mistral family)."""

    name = "mistral"
    stop: tuple[str, ...] = ()
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def parse(self, text: str, tools: Sequence[str] | None = None) -> Parsed:
        out = _Collector(tools)
        first = text.find(self.MARK)
        if first < 0:
            return out.result(text)
        self._walk(text, first + len(self.MARK), out)
        return out.result(text[:first])

    def incomplete(self, text: str) -> bool:
        first = text.find(self.MARK)
        if first < 0:
            return False
        out = _Collector(None)
        return self._walk(text, first + len(self.MARK), out)

    def _walk(self, text: str, pos: int, out: _Collector) -> bool:
        """Parse every call from ``pos`` into ``out``; True when the message was cut inside one."""
        while True:
            pos = skip_space(text, pos)
            if pos >= len(text):
                if not out.calls and not out.errors:
                    out.error(pos, f"nothing after {self.MARK} (cut off before the first call)")
                    return True
                return False
            if text[pos] in "[{":
                ok, obj, end = out.read(text, pos, "cut off inside the JSON calls (they never close)")
                if end is None:
                    return True
                if ok:
                    for item in obj if isinstance(obj, list) else [obj]:
                        out.add_object(pos, item, ("arguments", "parameters"))
            else:
                end = self._named_call(text, pos, out)
                if end is None:
                    return True
                if end < 0:
                    return False
            pos = skip_space(text, end)
            if text.startswith(self.MARK, pos):
                pos += len(self.MARK)
            elif pos < len(text):
                out.error(pos, f"unexpected text after the calls: {excerpt(text, pos)}")
                return False

    def _named_call(self, text: str, pos: int, out: _Collector) -> int | None:
        """One ``name[ARGS]{json}`` call: the index past it, None when cut off, -1 after a fatal error."""
        args = text.find(self.ARGS, pos)
        if args < 0:
            rest = text[pos:pos + 300].strip()
            bracket = rest.rfind("[")
            if bracket >= 0 and (self.ARGS.startswith(rest[bracket:]) or self.CALL_ID.startswith(rest[bracket:])):
                rest = rest[:bracket]  # cut inside a marker
            if _MISTRAL_NAME.fullmatch(rest) or self.CALL_ID in text[pos:]:
                out.error(pos, f"cut off before {self.ARGS}: {excerpt(text, pos)}")
                return None
            out.error(pos, f"expected a JSON list or name{self.ARGS}{{...}} after {self.MARK}, got "
                           f"{excerpt(text, pos)}")
            return -1
        name = text[pos:args]
        call_id = name.find(self.CALL_ID)
        if call_id >= 0:
            name = name[:call_id]
        name = name.strip()
        if _MISTRAL_NAME.fullmatch(name) is None:
            out.error(pos, f"tool name {excerpt(name)} before {self.ARGS} is not a function name "
                           "(letters, digits, '_', '.', '-')")
            return -1
        body = skip_space(text, args + len(self.ARGS))
        if body >= len(text):
            out.error(pos, f"cut off after {self.ARGS} of {name!r}")
            return None
        if text[body] != "{":
            out.error(body, f"arguments of {name!r} must be a JSON object, got {excerpt(text, body)}")
            return -1
        ok, arguments, end = out.read(text, body, f"cut off inside the arguments of {name!r}")
        if end is None:
            return None
        if ok:
            checked = out.arguments(body, name, arguments, "arguments")
            if checked is not None:
                out.add(pos, name, checked)
        return end


# ---------------------------------------------------------------------------------------------------------
# markdown (the code-block tools of services.tasks.tools)


_FENCE_OPEN = re.compile(r"(?:^|\n)```([^\n`]*)\n")  # the opening fence as tools.parse_tool_call finds it


class MarkdownParser:
    """The code-block tools of :mod:`services.tasks.tools` (``write``/``python``/``bash``), one per message."""

    name = "markdown"
    stop: tuple[str, ...] = (markdown_tools.FENCE_STOP,)

    def parse(self, text: str, tools: Sequence[str] | None = None) -> Parsed:
        enabled = markdown_tools.TOOLS if tools is None else tuple(tools)
        out = _Collector(None)
        call = markdown_tools.parse_tool_call(text, enabled)
        if call is None:
            if markdown_tools.opens_block(text):
                opening = _FENCE_OPEN.search(text)
                at = opening.start() if opening is not None else 0
                out.error(at, f"cut off inside a code block (no closing ```): {excerpt(text, at)}")
                return out.result(text[:at])
            return out.result(text)
        opening = _FENCE_OPEN.search(text)
        at = opening.start() if opening is not None else 0
        content = text[:at]
        if isinstance(call, markdown_tools.NotATool):
            out.error(at, f"a ```{call.language} block is no tool; the tools are: {', '.join(enabled)}")
            return out.result(content)
        if call.tool == "write":
            out.add(at, "write", {"path": call.path, "content": call.body})
        elif call.tool == "python":
            out.add(at, "python", {"code": call.body})
        else:
            out.add(at, "bash", {"command": call.body})
        return out.result(content)

    def incomplete(self, text: str) -> bool:
        return markdown_tools.parse_tool_call(text) is None and markdown_tools.opens_block(text)


# ---------------------------------------------------------------------------------------------------------
# registry


PARSERS: dict[str, ToolCallParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), MarkdownParser())
}


def get_parser(name: str) -> ToolCallParser:
    """The parser called ``name``; :class:`UnknownParserError` listing the known names otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise UnknownParserError(
            f"unknown tool-call parser {name!r}; the parsers are: {', '.join(sorted(PARSERS))} "
            "(set the parser name to one of them, or leave it out to guess it from the model)"
        ) from None


def parse(text: str, parser_name: str, tools: Sequence[str] | None = None) -> Parsed:
    """``get_parser(parser_name).parse(text, tools)``."""
    return get_parser(parser_name).parse(text, tools)


# (marker in a chat template, family) checked first, then (substring of a model name, family)
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"),
)
_NAME_HINTS: tuple[tuple[Callable[[str], bool], str], ...] = (
    (lambda n: "qwen" in n or "hermes" in n, "hermes"),
    (lambda n: re.search(r"llama[-_ ]?3", n) is not None, "llama3_json"),
    (lambda n: any(k in n for k in ("mistral", "mixtral", "ministral", "magistral", "devstral")), "mistral"),
)


def parser_for_model(model_name_or_template: str) -> str:
    """A best guess of the parser name for a model, from its chat template or its name.

    A chat template names its format: ``<tool_call>`` → ``hermes``, ``<|python_tag|>`` →
    ``llama3_json``, ``[TOOL_CALLS]`` → ``mistral``. Otherwise the (case-insensitive) model name:
    ``qwen``/``hermes`` → ``hermes``, ``llama-3``/``llama3`` → ``llama3_json``, the Mistral family
    (``mistral``, ``mixtral``, ``ministral``, ``magistral``, ``devstral``) → ``mistral``. Anything
    else → ``markdown``, which any chat model can follow. It is a guess: a fine-tune may use another
    format than its base, so configuration should be able to name the parser outright.
    """
    for marker, family in _TEMPLATE_MARKERS:
        if marker in model_name_or_template:
            return family
    lowered = model_name_or_template.lower()
    # a template without markers may still mention a family, but only a short string is taken as a name
    if len(lowered) <= 200:
        for matches, family in _NAME_HINTS:
            if matches(lowered):
                return family
    return "markdown"
