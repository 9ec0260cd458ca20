"""Tools through a real chat template: a Qwen2.5-style template renders function_schema's output and the
calls it renders round-trip through the hermes parser (and through a tokenizer). Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.tasks.function_tools import check_call, function_schema, tools_by_name
from services.tasks.toolcalls import get_parser, parse, parser_for_model
from tests.agentic.agentic_harness import chat_tokenizer

TEMPLATE = Path(__file__).with_name("qwen_tools_template.jinja")
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def get_weather(city: str, unit: str = "celsius", days: list[int] | None = None) -> str:
    """The weather forecast for a city.

    Args:
        city: the city's name, e.g. "Oslo".
        unit: celsius or fahrenheit.
        days: which days ahead (0 is today).
    """
    return "sunny"


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer over printable ASCII with Qwen's specials and the tools template."""
    return chat_tokenizer(TEMPLATE.read_text(), SPECIALS)


CALLS = [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": [0, 1]}}},
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bergen \"Vestland\"",
                                                                           "unit": "fahrenheit"}}},
]
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": "Let me check both.", "tool_calls": CALLS},
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "rain"},
]


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=[function_schema(get_weather)], tokenize=False, **kwargs)


def test_template_renders_the_tool_schema(tokenizer):
    text = render(tokenizer, MESSAGES[:1], add_generation_prompt=True)
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_block) == function_schema(get_weather)
    assert '"description": "the city\'s name, e.g. \\"Oslo\\"."' in tools_block
    assert text.endswith("<|im_start|>assistant\n")
    assert parser_for_model(tokenizer.chat_template) == "hermes"


def test_rendered_calls_round_trip_through_the_hermes_parser(tokenizer):
    text = render(tokenizer, MESSAGES)
    assistant = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    parsed = parse(assistant, "hermes", tools=["get_weather"])
    assert parsed.errors == []
    assert parsed.content == "Let me check both."
    assert [(c.id, c.name, c.arguments) for c in parsed.calls] == [
        (f"call_{i}", call["function"]["name"], call["function"]["arguments"]) for i, call in enumerate(CALLS)]
    # the tool results come back as <tool_response> blocks inside one user turn
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>" \
        "<|im_end|>" in text
    # and the parsed calls are valid for the tool they name
    tools = tools_by_name([get_weather])
    assert all(check_call(tools, c.name, c.arguments) == [] for c in parsed.calls)


def test_generated_tokens_decode_to_parseable_calls(tokenizer):
    """What an engine sees: the assistant turn as token ids, decoded back, cut or whole."""
    whole = render(tokenizer, MESSAGES[:2])
    assistant = whole.split("<|im_start|>assistant\n", 1)[1]
    ids = tokenizer.encode(assistant, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # a single special token, as in Qwen
    decoded = tokenizer.decode(ids, skip_special_tokens=False).removesuffix("<|im_end|>\n")
    assert [c.arguments for c in parse(decoded, "hermes").calls] == [c["function"]["arguments"] for c in CALLS]
    # cut by a token limit inside the second call: the first is a call, the second an error
    second = decoded.rindex("<tool_call>")
    cut_ids = tokenizer.encode(decoded[: second + 30], add_special_tokens=False)
    cut = tokenizer.decode(cut_ids, skip_special_tokens=False)
    assert get_parser("hermes").incomplete(cut)
    parsed = parse(cut, "hermes")
    assert [c.arguments for c in parsed.calls] == [CALLS[0]["function"]["arguments"]]
    assert parsed.errors == [f"tool call at char {second}: cut off before </tool_call> (the message ended "
                             f"inside the call): {cut[second:]!r}"]
