"""Observation tokens: what follows an assistant message in the chat template, rendered once per observation.

The trainer's forward pass runs over ``prompt + all turns``; an observation's ``Turn(role="tool")`` holds
exactly the tokens the model is conditioned on next: the end of the assistant's message (unless the model
already closed it), the observation message(s) as the template renders them, and the next assistant header.
The assistant's own tokens are never re-tokenised: only this suffix is encoded.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("rlbus.rollout.frame")

#: a frame for tokenizers without a chat template (or templates that refuse the observation's role)
PLAIN = ("\n\n[output]\n", "\n[/output]\n\n")


class ChatFrame:
    """Turns an observation into the tokens that follow an assistant message, using the chat template.

    The template is rendered once around two markers; what follows the assistant's content (its
    end-of-message, the observation message's header) and what follows the observation (its end, the next
    assistant header) frame every observation. Tokenizers without a chat template get a plain-text frame.

    :meth:`messages` frames tool results (``role="tool"`` with ``tool_call_id`` and ``name``, several in a row
    for parallel calls) by rendering them for real after a marker assistant message: templates group, wrap
    and label tool results in their own ways (Qwen's ``<tool_response>`` blocks inside one user turn, Llama's
    ``ipython`` role), so no fixed frame would fit them all. A template that refuses them gets the results
    as one message of :attr:`role` (or the plain frame).
    """

    _A = "\x00ASSISTANT\x00"
    _O = "\x00OBSERVATION\x00"
    _PREFIX = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]

    def __init__(self, tokenizer: Any, role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.role = role
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_text = tokenizer.eos_token or ""
        self.templated = bool(getattr(tokenizer, "chat_template", None))  # tokenizers may lack the attribute
        self.head, self.tail = self._frame()
        self.renders_tool_messages = True

    def _frame(self) -> tuple[str, str]:
        if self.templated:
            try:
                after = self._after_marker([{"role": self.role, "content": self._O}])
            except Exception as e:  # templates may refuse roles or orders: fall back to plain text
                log.warning("chat template cannot render a %r observation (%s); using a plain-text frame",
                            self.role, e)
            else:
                if self._O in after:
                    head, tail = after.split(self._O, 1)
                    return head, tail
        return PLAIN

    def _after_marker(self, messages: list[dict[str, Any]]) -> str:
        rendered = self.tokenizer.apply_chat_template(
            [*self._PREFIX, {"role": "assistant", "content": self._A}, *messages],
            add_generation_prompt=True, tokenize=False)
        return rendered.split(self._A, 1)[-1]

    def _encode(self, assistant_ids: list[int], text: str) -> tuple[list[int], str]:
        if assistant_ids and assistant_ids[-1] in self.eos_ids and self.eos_text and text.startswith(self.eos_text):
            text = text[len(self.eos_text):]  # the model already closed its message
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids, self.tokenizer.decode(ids, skip_special_tokens=True)

    def observation(self, assistant_ids: list[int], text: str) -> tuple[list[int], str]:
        """Token ids (and their text without special tokens) of one observation after ``assistant_ids``."""
        return self._encode(assistant_ids, self.head + text + self.tail)

    def messages(self, assistant_ids: list[int], messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        """Token ids (and text) of observation ``messages`` (tool results and others) after ``assistant_ids``."""
        if self.templated and self.renders_tool_messages:
            try:
                return self._encode(assistant_ids, self._after_marker(messages))
            except Exception as e:  # e.g. a template that wants tool_calls on the assistant message
                log.warning("chat template cannot render tool messages (%s); observations go as %r messages",
                            e, self.role)
                self.renders_tool_messages = False
        text = "\n\n".join(_labelled(m) for m in messages)
        return self.observation(assistant_ids, text)


def _labelled(m: dict[str, Any]) -> str:
    if m.get("role") == "tool":
        return f"[{m.get('name') or 'tool'} {m.get('tool_call_id', '')}]\n{m.get('content', '')}".replace(" ]", "]")
    return str(m.get("content", ""))
