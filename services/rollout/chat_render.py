"""Messages to token ids through the chat template, and the tokens that continue a previous call's sequence.

The endpoint's first call of a segment renders its messages with the tokenizer's chat template (tools
included) and encodes the text once. A call that *continues* the previous one (its messages are that
call's messages + the assistant message the endpoint returned + new ones) is never re-rendered as a whole:
its prompt is the previous prompt ids + the generated ids + the ids of what the template renders after the
assistant message (:meth:`ChatRenderer.continuation`), so the model's own tokens stay exactly as sampled.

**The suffix.** The template renders the history three times as text: the previous prompt (with the
generation prompt), the previous prompt + the assistant message (without), and the new messages (with).
When each is a prefix of the next, the suffix is the text the template puts after the assistant message's
end, preceded by the *tail*: what the template renders after what the model wrote. When the model ended
its message with EOS, the tail is what follows the template's end-of-message (Qwen's ``"\\n"`` after
``<|im_end|>``); when it stopped otherwise (a stop string, the token limit), the tail starts with the
template's end-of-message. A template that renders history differently than it did (e.g. one that drops
older reasoning) is no continuation: the call starts a new segment.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]


class RenderError(ValueError):
    """The chat template cannot render these messages (the client's request is at fault)."""


def message_key(m: Message) -> tuple[Any, ...]:
    """What identifies a normalised message when a continuing call sends it back (tool call ids of an
    assistant message are left out: clients may rewrite them)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return (m["role"], m.get("content") or "", calls, m.get("tool_call_id") if m["role"] == "tool" else None)


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class ChatRenderer:
    """Chat-template rendering and encoding with one tokenizer (it must have a chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        self.templated = bool(getattr(tokenizer, "chat_template", None))  # tokenizers may lack the attribute

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None, generation_prompt: bool) -> str:
        if not self.templated:
            raise RenderError("the model's tokenizer has no chat template: use /v1/completions with a prompt")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises its own errors (a role the template refuses, raise_exception)
            raise RenderError(f"the chat template cannot render these messages: {e}") from e

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    def prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> tuple[list[int], str]:
        """The ids of ``messages`` rendered whole, ending with the assistant's generation prompt, and that text
        (a continuing call's ``before``)."""
        text = self.render(messages, tools, True)
        return self.encode(text), text

    def continuation(self, previous: list[Message], messages: list[Message], tools: list[dict[str, Any]] | None,
                     generated: list[int], before: str | None = None) -> tuple[list[int], str] | None:
        """The ids that follow ``generated`` when ``messages`` = ``previous`` + the assistant message the
        model generated as ``generated`` + new messages, and ``messages`` rendered with the generation prompt
        (the next continuation's ``before``); None when the template renders the history differently (then
        the caller renders ``messages`` whole). ``before``: ``previous`` so rendered, when the caller kept it
        from the previous call (each render costs as much as the whole history: an agent loop then pays two
        per call, not three)."""
        k = len(previous)
        if before is None:
            before = self.render(previous, tools, True)
        with_assistant = self.render(messages[:k + 1], tools, False)
        full = self.render(messages, tools, True)
        if not with_assistant.startswith(before) or not full.startswith(with_assistant):
            return None
        return self.encode(self._tail(with_assistant[len(before):], generated) + full[len(with_assistant):]), full

    def _tail(self, assistant: str, generated: list[int]) -> str:
        """What the template renders after the model's own tokens of its message."""
        written = self.decode(generated, special=True)
        if assistant.startswith(written):
            return assistant[len(written):]
        at = assistant.rfind(self.eos_text) if self.eos_text else -1
        if at < 0:
            return ""
        if generated and generated[-1] == self.eos_id:
            return assistant[at + len(self.eos_text):]  # the model closed its message itself
        return assistant[at:]
