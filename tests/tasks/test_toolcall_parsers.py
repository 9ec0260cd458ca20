"""Tool-call parsers: each family's calls, parallel calls, content, malformed and cut calls, the registry."""

from __future__ import annotations

import pytest

from services.tasks import tools as markdown_tools
from services.tasks.toolcalls import (
    PARSERS,
    Parsed,
    ToolCall,
    UnknownParserError,
    get_parser,
    json_end,
    parse,
    parser_for_model,
)

SEARCH = ToolCall(id="call_0", name="search", arguments={"q": "nats", "n": 3})


# ---------------------------------------------------------------------------------------------------------
# hermes


def test_hermes_one_call_with_content_before_it():
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "nats", "n": 3}}\n</tool_call>'
    assert parse(text, "hermes") == Parsed(content="Let me look.", calls=[SEARCH], errors=[])


def test_hermes_parallel_calls_are_numbered_in_order():
    text = ('<tool_call>{"name": "search", "arguments": {"q": "nats", "n": 3}}</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    parsed = parse(text, "hermes")
    assert parsed.calls == [SEARCH, ToolCall(id="call_1", name="now", arguments={})]
    assert parsed.content == "" and parsed.errors == []


def test_hermes_message_without_calls_is_content():
    assert parse("The answer is 4.", "hermes") == Parsed(content="The answer is 4.")


def test_hermes_accepts_parameters_and_missing_arguments():
    text = ('<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call>')
    assert [(c.name, c.arguments) for c in parse(text, "hermes").calls] == [("a", {"x": 1}), ("b", {})]


def test_hermes_malformed_json_is_an_error_and_later_calls_still_parse():
    text = ('<tool_call>{"name": "search", "arguments": {"q": "nats",}}</tool_call>'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    parsed = parse(text, "hermes")
    assert [c.name for c in parsed.calls] == ["now"]
    assert parsed.calls[0].id == "call_0"
    [error] = parsed.errors
    assert error.startswith("tool call at char 11: invalid JSON (")
    assert '"q": "nats",}' in error  # quotes the offending text


def test_hermes_missing_name_and_non_object_arguments():
    text = ('<tool_call>{"arguments": {"q": 1}}</tool_call>'
            '<tool_call>{"name": "", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>'
            '<tool_call>{"name": "search", "arguments": "not json"}</tool_call>'
            '<tool_call>["search"]</tool_call>')
    parsed = parse(text, "hermes")
    assert parsed.calls == []
    assert len(parsed.errors) == 5
    assert 'no "name"' in parsed.errors[0]
    assert '"name" is \'""\'' in parsed.errors[1]
    assert "\"arguments\" of 'search' must be a JSON object, got list" in parsed.errors[2]
    assert "got the string 'not json'" in parsed.errors[3]
    assert "expected a JSON object" in parsed.errors[4] and "got list" in parsed.errors[4]


def test_hermes_arguments_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"nats\\", \\"n\\": 3}"}</tool_call>'
    assert parse(text, "hermes").calls == [SEARCH]


def test_hermes_cut_call_is_an_error_not_a_call():
    text = 'Looking.<tool_call>{"name": "search", "arguments": {"q": "na'
    parsed = parse(text, "hermes")
    assert parsed.calls == [] and parsed.content == "Looking."
    assert "cut off before </tool_call>" in parsed.errors[0]
    assert get_parser("hermes").incomplete(text)
    assert not get_parser("hermes").incomplete(text + '"}}</tool_call>')
    assert not get_parser("hermes").incomplete("no call")


def test_tools_filter_turns_unknown_names_into_errors():
    text = '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>{"name": "now"}</tool_call>'
    parsed = parse(text, "hermes", tools=["search", "now"])
    assert [c.name for c in parsed.calls] == ["now"]
    assert parsed.errors == ["tool call at char 11: unknown tool 'rm'; the tools are: search, now"]


# ---------------------------------------------------------------------------------------------------------
# llama3_json


def test_llama3_one_call_bare_and_with_python_tag():
    bare = '{"name": "search", "parameters": {"q": "nats", "n": 3}}'
    assert parse(bare, "llama3_json") == Parsed(content="", calls=[SEARCH])
    tagged = 'Searching.<|python_tag|>{"name": "search", "arguments": {"q": "nats", "n": 3}}'
    assert parse(tagged, "llama3_json") == Parsed(content="Searching.", calls=[SEARCH])


def test_llama3_parallel_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "search", "parameters": {"q": "nats", "n": 3}}; {"name": "now", "parameters": {}};'
    parsed = parse(text, "llama3_json")
    assert parsed.calls == [SEARCH, ToolCall(id="call_1", name="now", arguments={})]
    assert parsed.errors == []


def test_llama3_plain_text_is_content():
    assert parse("It is {probably} 4.", "llama3_json") == Parsed(content="It is {probably} 4.")


def test_llama3_malformed_missing_name_non_object_arguments():
    parsed = parse('{"name": "search", "parameters": {"q": nats}}', "llama3_json")
    assert parsed.calls == [] and parsed.errors[0].startswith("tool call at char 0: invalid JSON (")
    parsed = parse('{"parameters": {}}; {"name": "now", "parameters": 3}', "llama3_json")
    assert parsed.calls == []
    assert 'no "name"' in parsed.errors[0]
    assert "\"parameters\" of 'now' must be a JSON object, got int: '3'" in parsed.errors[1]


def test_llama3_builtin_tool_syntax_and_trailing_text_are_errors():
    parsed = parse('<|python_tag|>brave_search.call(query="nats")', "llama3_json")
    assert parsed.calls == [] and "built-in tools such as brave_search are not supported" in parsed.errors[0]
    parsed = parse('{"name": "now", "parameters": {}} and then', "llama3_json")
    assert [c.name for c in parsed.calls] == ["now"]
    assert "expected ';' or the end of the message" in parsed.errors[0]


def test_llama3_cut_call():
    text = '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "search", "parameters": {"q": "na'
    parsed = parse(text, "llama3_json")
    assert [c.name for c in parsed.calls] == ["now"]
    assert "cut off inside the JSON object" in parsed.errors[0]
    parser = get_parser("llama3_json")
    assert parser.incomplete(text)
    assert not parser.incomplete('{"name": "now", "parameters": {}}')
    assert not parser.incomplete("plain {")


# ---------------------------------------------------------------------------------------------------------
# mistral


def test_mistral_json_list_with_content_before_it():
    text = 'Sure. [TOOL_CALLS][{"name": "search", "arguments": {"q": "nats", "n": 3}}, {"name": "now", "arguments": {}}]'
    parsed = parse(text, "mistral")
    assert parsed == Parsed(content="Sure.", calls=[SEARCH, ToolCall(id="call_1", name="now", arguments={})])


def test_mistral_named_form_parallel_and_call_ids_ignored():
    text = '[TOOL_CALLS]search[ARGS]{"q": "nats", "n": 3}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}'
    parsed = parse(text, "mistral")
    assert parsed == Parsed(content="", calls=[SEARCH, ToolCall(id="call_1", name="now", arguments={})])


def test_mistral_errors():
    parsed = parse('[TOOL_CALLS][{"arguments": {}}, {"name": "now", "arguments": [1]}, 7]', "mistral")
    assert parsed.calls == []
    assert 'no "name"' in parsed.errors[0]
    assert "\"arguments\" of 'now' must be a JSON object" in parsed.errors[1]
    assert "got int" in parsed.errors[2]
    parsed = parse('[TOOL_CALLS]search[ARGS]{"q": nats}', "mistral")
    assert parsed.calls == [] and "invalid JSON" in parsed.errors[0]
    parsed = parse("[TOOL_CALLS]search[ARGS][1]", "mistral")
    assert "arguments of 'search' must be a JSON object" in parsed.errors[0]
    parsed = parse('[TOOL_CALLS]two words[ARGS]{}', "mistral")
    assert "is not a function name" in parsed.errors[0]
    parsed = parse("[TOOL_CALLS]Well, I think the answer is 4.", "mistral")
    assert "expected a JSON list or name[ARGS]{...}" in parsed.errors[0]


def test_mistral_cut_calls():
    parser = get_parser("mistral")
    for text in ('[TOOL_CALLS][{"name": "search", "arguments": {"q": "na',
                 '[TOOL_CALLS]search[ARGS]{"q": "na',
                 "[TOOL_CALLS]search[AR",
                 "[TOOL_CALLS]search[ARGS]",
                 "[TOOL_CALLS]"):
        parsed = parse(text, "mistral")
        assert parsed.calls == [] and "cut off" in parsed.errors[0], text
        assert parser.incomplete(text), text
    assert not parser.incomplete('[TOOL_CALLS]now[ARGS]{}')
    assert not parser.incomplete("no calls")


# ---------------------------------------------------------------------------------------------------------
# markdown: the code-block tools of services.tasks.tools


MARKDOWN_CASES = [
    "I will write it.\n```python file=solution.py\ndef f():\n    return 1\n```\n",
    "Run it:\n```python\nprint(1 + 1)\n```\n",
    "```bash\nls -la\n```\n",
    "```sh\necho hi\n```",
    "Here:\n```rust\nfn main() {}\n```\n",
    "No tools today, the answer is 4.",
    "```python\nprint('cut",
]


@pytest.mark.parametrize("text", MARKDOWN_CASES)
def test_markdown_matches_parse_tool_call(text):
    expected = markdown_tools.parse_tool_call(text)
    parsed = parse(text, "markdown")
    if isinstance(expected, markdown_tools.ToolCall):
        [call] = parsed.calls
        assert parsed.errors == []
        arguments = {"write": {"path": expected.path, "content": expected.body},
                     "python": {"code": expected.body},
                     "bash": {"command": expected.body}}[expected.tool]
        assert call == ToolCall(id="call_0", name=expected.tool, arguments=arguments)
    elif isinstance(expected, markdown_tools.NotATool):
        assert parsed.calls == []
        assert f"a ```{expected.language} block is no tool" in parsed.errors[0]
    else:
        assert parsed.calls == []
        assert bool(parsed.errors) == markdown_tools.opens_block(text)
    assert get_parser("markdown").incomplete(text) == (expected is None and markdown_tools.opens_block(text))


def test_markdown_content_and_enabled_tools():
    parsed = parse("Run it:\n```python\nprint(1)\n```\n", "markdown", tools=["bash"])
    assert parsed.calls == [] and parsed.content == "Run it:"
    assert parsed.errors == ["tool call at char 7: a ```python block is no tool; the tools are: bash"]
    assert get_parser("markdown").stop == (markdown_tools.FENCE_STOP,)


# ---------------------------------------------------------------------------------------------------------
# registry, guessing, bounds


def test_registry_and_unknown_parser_name():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "markdown"}
    assert all(get_parser(name).name == name for name in PARSERS)
    assert {name: p.stop for name, p in PARSERS.items() if name != "markdown"} == {
        "hermes": (), "llama3_json": (), "mistral": ()}
    with pytest.raises(UnknownParserError) as info:
        get_parser("qwen")
    assert "unknown tool-call parser 'qwen'; the parsers are: hermes, llama3_json, markdown, mistral" in str(info.value)


@pytest.mark.parametrize(("hint", "family"), [
    ("Qwen/Qwen2.5-7B-Instruct", "hermes"),
    ("NousResearch/Hermes-3-Llama-3.1-8B", "hermes"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama3_json"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
    ("mistralai/Devstral-Small-2505", "mistral"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "markdown"),
    ("tiny", "markdown"),
    ("{% for m in messages %}...<tool_call>...{% endfor %}", "hermes"),
    ("{{- '<|python_tag|>' }}", "llama3_json"),
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
])
def test_parser_for_model(hint, family):
    assert parser_for_model(hint) == family


def test_json_end_skips_brackets_inside_strings():
    text = '{"a": "}]\\" {", "b": [1, {"c": 2}]} tail'
    assert text[:json_end(text, 0)] == '{"a": "}]\\" {", "b": [1, {"c": 2}]}'
    assert json_end('{"a": [1, 2', 0) is None
    assert json_end('{"a": "never closes', 0) is None


BIG = 10_000  # about 2,000 tokens of text


@pytest.mark.parametrize(("name", "text", "needle"), [
    # unterminated string full of escapes: the worst case for a backtracking string pattern
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": "' + '\\"\\\\' * (BIG // 4) + "</tool_call>", "invalid JSON"),
    ("hermes", "<tool_call>" + "{[" * (BIG // 2), "cut off before </tool_call>"),
    # deep nesting that closes: the decoder's recursion limit is an error, not an exception
    ("hermes", "<tool_call>" + "[" * (BIG // 2) + "]" * (BIG // 2) + "</tool_call>", "nested too deeply"),
    ("llama3_json", '{"a": ' + "[" * (BIG // 2) + "]" * (BIG // 2) + "}", "nested too deeply"),
    ("llama3_json", '{"name": "a", "parameters": ' + '{"k": [' * (BIG // 7), "cut off inside the JSON object"),
    ("llama3_json", "{" + '"' * BIG + "}", "invalid JSON"),
    ("mistral", "[TOOL_CALLS]" + '[{"' * (BIG // 3), "cut off"),
    ("mistral", "[TOOL_CALLS]" + "a" * BIG + "[ARGS]{}", "is not a function name"),
    ("mistral", "[TOOL_CALLS]x[ARGS]" + '{"a": "\\' * (BIG // 8), "cut off inside the arguments"),
    ("markdown", "```python\n" + "print('```')\n" * (BIG // 14), "cut off inside a code block"),
])
def test_large_broken_input_is_one_bounded_error(name, text, needle):
    parsed = parse(text, name)
    assert parsed.calls == []
    assert len(parsed.errors) == 1 and needle in parsed.errors[0]
    assert len(parsed.errors[0]) < 400  # the error quotes an excerpt, not the whole message
