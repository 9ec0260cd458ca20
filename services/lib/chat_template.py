"""A run's own chat template (``[model] chat_template``): a Jinja file that replaces the tokenizer's template.

Some models' templates render no tools (SmolLM2-135M-Instruct's renders roles and contents only), so an
agentic run on them ships a template that does (``examples/chat_templates/chatml_tools.jinja``: ChatML with
Qwen2.5's ``<tools>`` block and ``<tool_call>``/``<tool_response>`` framing). Every process that renders
chats for the policy applies it to its tokenizer: the trainer (the prompts' tokens, tools included) and the
rollout (the observation tokens between turns, the OpenAI-compatible endpoints). The judge scores texts and
renders no chat of the policy.

:func:`read_chat_template` is the start-up check (the launcher runs it on the run file before any service
starts, and each service again when it applies the file): the file exists and is UTF-8, it is valid Jinja,
and it renders a conversation with a tool such that the tool's name appears in the text. A relative path is
taken from the working directory (the repository root under ``./rlbus``), as ``[run] dir`` is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.runtime.config import ConfigError

KEY = "model.chat_template"
#: the probe tool the start-up check renders (its name must appear in the rendered text)
_PROBE_TOOL = {"type": "function", "function": {
    "name": "rlbus_probe_tool", "description": "A tool the start-up check renders.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "a number"}},
                   "required": ["x"]}}}
_PROBE_MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def read_chat_template(path: str) -> str:
    """The template text in ``path``, checked: it renders a conversation with tools, naming the tool.

    Raises:
        ConfigError: naming ``model.chat_template`` and what is wrong (missing file, not Jinja, a render
            error, or tools not rendered).
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config key {KEY}: {path!r} does not exist (relative paths are taken from the "
                          f"working directory, {Path.cwd()})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config key {KEY}: cannot read {path!r}: {e}") from None
    try:
        rendered = render(text, _PROBE_MESSAGES, tools=[_PROBE_TOOL], add_generation_prompt=True)
    except Exception as e:  # a Jinja syntax or render error, or the template's own raise_exception
        raise ConfigError(f"config key {KEY}: {path!r} does not render a chat with tools: "
                          f"{type(e).__name__}: {e}") from None
    if _PROBE_TOOL["function"]["name"] not in rendered:
        raise ConfigError(f"config key {KEY}: {path!r} renders no tools (the probe tool's name is not in its "
                          "output); a template for tool calls must render the `tools` it is given")
    return text


def render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """``template`` rendered as transformers renders chat templates (sandboxed Jinja, trimmed blocks,
    ``loopcontrols``, ``raise_exception``); for the start-up check, without loading a tokenizer."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **kwargs)


def use_chat_template(tokenizer: Any, path: str) -> None:
    """Replace ``tokenizer``'s chat template with the file ``path`` names (checked); nothing when empty."""
    if not path:
        return
    if tokenizer is None:
        raise ConfigError(f"config key {KEY}: this engine has no tokenizer to apply {path!r} to")
    tokenizer.chat_template = read_chat_template(path)
