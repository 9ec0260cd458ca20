"""The endpoint through the real ``openai`` client against a real server over the real tiny torch engine:
models, chat completions (plain, tools rendered by the Qwen-style template, streaming, logprobs, n),
completions, token-exact capture (the captured ids are the engine's), one sequence across continuing calls,
and bad input. Tool *calls* need a model that writes them, which the tiny random model does not: those tests
put the agentic tests' ScriptedEngine (an engine stand-in) behind the same endpoint."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from endpoint_harness import ADD_TOOL, CONTEXT, serving, tokenizer, torch_engine

from services.lib.engine.base import SamplingParams
from tests.agentic.agentic_harness import ScriptedEngine
from tests.conftest import wait_for_async

TOK = tokenizer()
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
async def engine():
    async with torch_engine(TOK) as e:
        yield e


def client(endpoint, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)


async def test_models_and_a_plain_chat_completion_capture_the_engines_own_tokens(engine):
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        assert [m.id for m in (await c.models.list()).data] == ["tiny"]
        r = await c.chat.completions.create(model="anything", messages=QUESTION, max_tokens=12, temperature=0,
                                            logprobs=True)
        [call] = session.calls
        prompt = TOK.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
        assert call.prompt_ids == TOK.encode(prompt, add_special_tokens=False)  # rendered by the chat template
        direct = await engine.generate(call.prompt_ids, SamplingParams(max_new_tokens=12, temperature=0))
        [captured] = call.choices
        assert captured.token_ids == direct.token_ids  # token-exact: the engine's ids, not a re-tokenisation
        assert captured.versions == [engine.version] * len(direct.token_ids)
        assert r.choices[0].message.content == direct.text and r.model == "tiny"
        assert [t.logprob for t in r.choices[0].logprobs.content] == captured.logprobs
        assert r.usage.prompt_tokens == len(call.prompt_ids) and r.usage.completion_tokens == len(direct.token_ids)
        assert r.choices[0].finish_reason == ("length" if direct.finish_reason == "length" else "stop")


async def test_continuing_calls_are_one_sequence_and_a_rewrite_is_a_new_segment(engine):
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        messages = list(QUESTION)
        for turn in range(3):
            r = await c.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL], max_tokens=6,
                                                temperature=0)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go {turn}"}]
        calls = list(session.calls)
        assert [x.segment for x in calls] == [0, 0, 0]
        for prev, nxt in zip(calls, calls[1:], strict=False):
            head = prev.prompt_ids + prev.choices[0].token_ids
            assert nxt.prompt_ids[:len(head)] == head and nxt.new_tokens == len(nxt.prompt_ids) - len(head)
        # the whole history rendered at once is what the continuing prompt holds (the template agrees)
        assert '"name": "add"' in TOK.decode(calls[0].prompt_ids)  # the tools, rendered by the template
        # the harness drops a turn: a new segment with its whole prompt
        await c.chat.completions.create(model="tiny", messages=QUESTION + messages[-2:], tools=[ADD_TOOL],
                                        max_tokens=4, temperature=0)
        assert session.calls[-1].segment == 1
        segments = ep.sessions.close(session.id).close()
        assert len(segments) == 2
        prompt, turns = segments[0].sequence()
        assert prompt == calls[0].prompt_ids
        assert [t.role for t in turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert [t.token_ids for t in turns if t.role == "assistant"] == [x.choices[0].token_ids for x in calls]
        assert prompt + [i for t in turns for i in t.token_ids] == calls[2].prompt_ids + calls[2].choices[0].token_ids


async def test_streaming_gives_the_same_completion_and_the_usage(engine):
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        plain = await c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=10, temperature=0)
        stream = await c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert text == plain.choices[0].message.content
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


async def test_n_choices_and_completions_with_text_and_token_prompts(engine):
    async with serving(engine, TOK, max_n=3) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        r = await c.chat.completions.create(model="tiny", messages=QUESTION, max_completion_tokens=6, n=3, seed=1)
        assert len(r.choices) == 3 and len(session.calls[-1].choices) == 3
        assert all(1 <= len(ch.token_ids) <= 6 for ch in session.calls[-1].choices)
        text = await c.completions.create(model="tiny", prompt="2 + 3 =", max_tokens=5, temperature=0, logprobs=1)
        ids = TOK.encode("2 + 3 =", add_special_tokens=False)
        direct = await engine.generate(ids, SamplingParams(max_new_tokens=5, temperature=0))
        assert session.calls[-1].prompt_ids == ids and session.calls[-1].choices[0].token_ids == direct.token_ids
        assert text.choices[0].text == direct.text
        assert text.choices[0].logprobs.token_logprobs == direct.logprobs
        by_ids = await c.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
        assert by_ids.choices[0].text == direct.text and session.calls[-1].prompt_ids == ids
        # a text prompt that extends the text call's prompt + its completion continues that call's sequence
        await c.completions.create(model="tiny", prompt="2 + 3 =" + direct.text + " ok", max_tokens=2, temperature=0)
        text_call, last = session.calls[1], session.calls[-1]
        assert last.segment == text_call.segment and last.new_tokens == len(" ok")
        assert last.prompt_ids == text_call.prompt_ids + text_call.choices[0].token_ids + TOK.encode(" ok")


async def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(engine):
    async with serving(engine, TOK, max_n=2, max_request_bytes=64 * 1024) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        with pytest.raises(openai.AuthenticationError, match="unknown session"):
            await client(ep, "rls-nope").chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="n = 3 is above") as e:
            await c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, n=3)
        assert e.value.code == "n_above_limit" and e.value.param == "n"
        long = [{"role": "user", "content": "x" * (CONTEXT + 10)}]
        with pytest.raises(openai.BadRequestError, match="context is 1024 tokens") as e:
            await c.chat.completions.create(model="tiny", messages=long, max_tokens=2)
        assert e.value.code == "context_length_exceeded"
        # the client's message quotes the body as Python prints it (openai 2.x escapes the quotes): read the body
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], tool_choice="required")
        assert (e.value.code, e.value.param) == ("unsupported", "tool_choice")
        assert "tool_choice 'required' is not supported" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="temperature must be in"):
            await c.chat.completions.create(model="tiny", messages=QUESTION, temperature=3)
        with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
            await c.chat.completions.create(model="tiny", messages=[])
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{ep.base_url}/chat/completions", data=b"{not json",
                                 headers={"Authorization": f"Bearer {session.id}"}) as resp:
                body = await resp.json()
                assert resp.status == 400 and body["error"]["code"] == "invalid_json"
                assert "not valid JSON" in body["error"]["message"]
            async with http.post(f"{ep.base_url}/chat/completions", json={"messages": QUESTION}) as resp:
                assert resp.status == 401 and "no session" in (await resp.json())["error"]["message"]
            big = {"messages": [{"role": "user", "content": "x" * 70_000}]}
            async with http.post(f"{ep.base_url}/chat/completions", json=big,
                                 headers={"Authorization": f"Bearer {session.id}"}) as resp:
                body = await resp.json()
                assert resp.status == 413 and "max_request_bytes" in body["error"]["message"]
            async with http.get(f"{ep.base_url}/nowhere") as resp:
                assert resp.status == 404 and "error" in await resp.json()
            # the session id in the path works without an API key
            url = ep.base_url.replace("/v1", f"/s/{session.id}/v1")
            async with http.post(f"{url}/chat/completions", json={"messages": QUESTION, "max_tokens": 2}) as resp:
                assert resp.status == 200
        assert [x.aborted for x in session.calls] == [None]  # refused requests recorded nothing
        ok = await c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
        assert ok.choices[0].message is not None


# --- tool calls: an engine stand-in writes them (see the module docstring) --------------------------------

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


async def test_tool_calls_are_parsed_and_the_tool_result_continues_the_sequence():
    engine = ScriptedEngine(TOK, [CALL, "The answer is 5."], version=4)
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        r = await c.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL])
        [tool_call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and tool_call.function.name == "add"
        assert json.loads(tool_call.function.arguments) == {"a": 2, "b": 3} and not r.choices[0].message.content
        messages = [*QUESTION, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": tool_call.id, "content": "5"}]
        r2 = await c.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL])
        assert r2.choices[0].message.content == "The answer is 5." and r2.choices[0].finish_reason == "stop"
        [segment] = ep.sessions.close(session.id).close()
        prompt, turns = segment.sequence(lambda ids: TOK.decode(ids, skip_special_tokens=False))
        assert [t.role for t in turns] == ["assistant", "tool", "assistant"]
        assert turns[0].text == CALL + "<|im_end|>" and turns[0].versions == [4] * len(turns[0].token_ids)
        assert "<tool_response>\n5\n</tool_response>" in turns[1].text  # the template's rendering, masked
        # the sequence is the template's rendering of the whole conversation (arguments as an object, as the
        # model wrote them; the client sent them back as a JSON string)
        called = {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
        full = TOK.apply_chat_template([*QUESTION, called, messages[2], {"role": "assistant", "content": "The answer is 5."}],
                                       tools=[ADD_TOOL], tokenize=False)
        assert TOK.decode(prompt + [i for t in turns for i in t.token_ids]) == full.removesuffix("\n")


async def test_a_client_that_disconnects_mid_stream_cancels_only_its_call():
    started = asyncio.Event()
    gone = asyncio.Event()

    async def hang(turn: int, context: str) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # a generation that only ends when cancelled
        except asyncio.CancelledError:
            gone.set()
            raise

    engine = ScriptedEngine(TOK, ["never"], hook=hang)
    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        stream = await c.chat.completions.create(model="tiny", messages=QUESTION, stream=True)
        first = await anext(aiter(stream))
        assert first.choices[0].delta.role == "assistant"
        await started.wait()
        await stream.close()  # the client goes away mid-stream
        await asyncio.wait_for(gone.wait(), 30)  # its generation was cancelled
        await wait_for_async(lambda: session.calls[0].aborted is not None, 30, "the call recorded as aborted")
        assert session.calls[0].aborted == "the client went away" and ep.counters["aborted"] == 1
        engine.hook = None
        ok = await c.chat.completions.create(model="tiny", messages=QUESTION)
        assert ok.choices[0].message.content == "never"
        assert session.calls[1].segment == 1  # the aborted call continues nothing


async def test_the_rollout_service_serves_the_endpoint_over_its_one_engine(engine):
    """[services.rollout] endpoint on: the service starts it over the engine its episodes use, reports it, and
    native episodes and endpoint calls share that engine at once."""
    from types import SimpleNamespace

    from services.rollout.config import EndpointSection, RolloutConfig
    from services.rollout.service import RolloutService
    from services.runtime.config import CommonSection, Loaded, ModelSection, NatsSection, RunSection

    loaded = Loaded(run=RunSection(id="ep"), nats=NatsSection(url="nats://unused:1"), common=CommonSection(),
                    model=ModelSection(name="tiny"),
                    service=RolloutConfig(endpoint=EndpointSection(enabled=True, served_model="policy")))
    svc = RolloutService(loaded)
    svc.attach(engine, TOK, sandboxes=None)
    ctx = SimpleNamespace(gauges={})
    await svc.serve_endpoint(ctx)
    try:
        assert svc.endpoint.engine is svc.engine and ctx.gauges["rollout/endpoint/port"] == svc.endpoint.port
        session = svc.endpoint.sessions.open()
        c = client(svc.endpoint, session.id)
        ids = TOK.encode("2 + 3 =", add_special_tokens=False)
        native, served = await asyncio.gather(
            engine.generate(ids, SamplingParams(max_new_tokens=6, temperature=0)),
            c.completions.create(model="policy", prompt=ids, max_tokens=6, temperature=0))
        assert served.choices[0].text == native.text and served.model == "policy"
    finally:
        await svc.endpoint.stop()


async def test_an_episode_spanning_two_weight_versions_records_both_per_token(engine):
    """New weights applied between two calls of one session: each generated token keeps the version that
    sampled it, and the assembled sequence holds both (the staleness filter reads its oldest)."""
    from endpoint_harness import tiny_model

    async with serving(engine, TOK) as ep:
        session = ep.sessions.open()
        c = client(ep, session.id)
        r = await c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, temperature=0)
        await engine.update_weights(tiny_model(TOK, seed=1).state_dict(), version=1)
        messages = [*QUESTION, r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        await c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        [segment] = ep.sessions.close(session.id).close()
        _, turns = segment.sequence()
        assert [set(t.versions) for t in turns if t.role == "assistant"] == [{0}, {1}]


async def test_a_stopped_engine_is_a_503_in_the_apis_shape_and_the_call_is_aborted():
    async with torch_engine(TOK) as engine, serving(engine, TOK) as ep:
        session = ep.sessions.open()
        await engine.stop()
        with pytest.raises(openai.InternalServerError, match="the engine cannot serve") as e:
            await client(ep, session.id).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "engine_unavailable"
        assert session.calls[0].aborted is not None and "engine" in session.calls[0].aborted


async def test_concurrent_sessions_batch_in_one_engine_and_keep_their_own_sequences(engine):
    """16 agents at once, two turns each: every session is one sequence of its own calls (its own question,
    its own answer's ids), while all share the engine's batches."""
    async with serving(engine, TOK) as ep:
        async def agent(i: int) -> tuple[object, list[int]]:
            session = ep.sessions.open(labels={"agent": str(i)})
            c = client(ep, session.id)
            messages = [{"role": "user", "content": f"What is {i} + {i}?"}]
            r = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            await c.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
            return ep.sessions.close(session.id), session.calls[0].choices[0].token_ids

        results = await asyncio.gather(*(agent(i) for i in range(16)))
        for i, (session, first) in enumerate(results):
            [segment] = session.close()
            assert session.labels == {"agent": str(i)} and [c.segment for c in session.calls] == [0, 0]
            assert f"What is {i} + {i}?" in TOK.decode(segment.token_ids)
            head = session.calls[0].prompt_ids + first
            assert segment.token_ids[:len(head)] == head and segment.generated[len(head) - 1]
        assert len(ep.sessions) == 0


async def test_concurrent_calls_reach_the_engine_together_not_one_after_another(engine):
    """The endpoint hands every concurrent call to the engine at once (no lock, no per-request engine): with
    the engine asleep, all 8 calls are pending in it together; woken, it admits them into its batch and
    every agent gets its answer."""
    async with serving(engine, TOK) as ep:
        sessions = [ep.sessions.open() for _ in range(8)]
        await engine.sleep()
        calls = [asyncio.create_task(client(ep, s.id).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=6))
            for i, s in enumerate(sessions)]
        await wait_for_async(lambda: engine.stats().pending == 8, 30, "8 calls pending in the sleeping engine")
        assert not any(c.done() for c in calls)
        await engine.wake_up()
        answers = await asyncio.gather(*calls)
        assert all(a.usage.completion_tokens == len(s.calls[0].choices[0].token_ids) > 0
                   for a, s in zip(answers, sessions, strict=True))
        assert engine.stats().pending == 0
