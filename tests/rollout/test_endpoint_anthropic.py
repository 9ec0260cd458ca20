"""The endpoint's Anthropic Messages API through the real ``anthropic`` client: a plain message on the real
tiny torch engine (token-exact), tool_use / tool_result continuing one sequence and streaming (the
ScriptedEngine stand-in writes the call, as in test_endpoint_openai.py), and errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import pytest
from endpoint_harness import serving, tokenizer, torch_engine

from services.lib.engine.base import SamplingParams
from tests.agentic.agentic_harness import ScriptedEngine

TOK = tokenizer()
ADD = {"name": "add", "description": "Add two integers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def client(endpoint, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=endpoint.base_url.removesuffix("/v1"), api_key=key, max_retries=0)


async def test_a_message_on_the_torch_engine_is_the_engines_own_tokens():
    async with torch_engine(TOK) as engine, serving(engine, TOK) as ep:
        session = ep.sessions.open()
        r = await client(ep, session.id).messages.create(model="tiny", max_tokens=10, extra_body={"temperature": 0},
                                                         system="Be brief.", messages=QUESTION)
        [call] = session.calls
        rendered = TOK.apply_chat_template([{"role": "system", "content": "Be brief."}, *QUESTION], tokenize=False,
                                           add_generation_prompt=True)
        assert call.prompt_ids == TOK.encode(rendered, add_special_tokens=False)
        direct = await engine.generate(call.prompt_ids, SamplingParams(max_new_tokens=10, temperature=0))
        assert call.choices[0].token_ids == direct.token_ids
        assert [b.type for b in r.content] == ["text"] and r.content[0].text == direct.text
        assert r.stop_reason == ("max_tokens" if direct.finish_reason == "length" else "end_turn")
        assert r.usage.input_tokens == len(call.prompt_ids) and r.usage.output_tokens == len(direct.token_ids)


async def test_tool_use_then_tool_result_is_one_sequence_and_streams():
    engine = ScriptedEngine(TOK, [CALL, "The answer is 5."])
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        r = await c.messages.create(model="tiny", max_tokens=200, messages=QUESTION, tools=[ADD])
        [use] = r.content
        assert r.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "add"
        assert use.input == {"a": 2, "b": 3}
        messages = [*QUESTION, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        async with c.messages.stream(model="tiny", max_tokens=200, messages=messages, tools=[ADD]) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(texts) == "The answer is 5." and final.stop_reason == "end_turn"
        assert [x.segment for x in session.calls] == [0, 0]  # the tool result continued the sequence
        [segment] = ep.sessions.close(session.id).close()
        _, turns = segment.sequence(lambda ids: TOK.decode(ids, skip_special_tokens=False))
        assert [t.role for t in turns] == ["assistant", "tool", "assistant"]
        assert "<tool_response>\n5\n</tool_response>" in turns[1].text


async def test_errors_come_in_anthropics_shape():
    engine = ScriptedEngine(TOK, ["hi"])
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        with pytest.raises(anthropic.AuthenticationError, match="unknown session"):
            await client(ep, "rls-nope").messages.create(model="tiny", max_tokens=5, messages=QUESTION)
        c = client(ep, session.id)
        with pytest.raises(anthropic.BadRequestError, match="tool_choice") as e:
            await c.messages.create(model="tiny", max_tokens=5, messages=QUESTION, tools=[ADD],
                                    tool_choice={"type": "any"})
        assert e.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError, match="image"):
            await c.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
        ok = await c.messages.create(model="tiny", max_tokens=5, messages=QUESTION)
        assert ok.content[0].text == "hi"
