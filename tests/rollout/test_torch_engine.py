"""The torch engine: continuous batching equals unbatched decoding, stops, logprobs, versions, load."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.lib.engine.base import (
    Engine,
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    InvalidRequestError,
    SamplingParams,
    WeightUpdateError,
)
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.kv_cache import PaddedBatchCache, cache_kwarg
from services.lib.engine.torch_engine import TorchEngine
from tests.conftest import wait_for_async

PROMPTS = ["hello world", "a", "the quick brown fox jumps", "1+2=", "RL on a bus"]


class SteppedEngine(TorchEngine):
    """A torch engine that records every step and runs test hooks in its thread after chosen steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step = 0
        self.hooks: dict[int, Callable[[], None]] = {}
        self.trace: list[tuple[list[int], int]] = []  # (real cached tokens per row, cache length)

    def _after_step(self) -> None:
        self.step += 1
        real = [len(r.seq.prompt_ids) + len(r.seq.tokens) - 1 for r in self._batch.rows]
        cache = self._batch.cache
        self.trace.append((real, cache.seq_length if cache is not None else 0))
        hook = self.hooks.pop(self.step, None)
        if hook is not None:
            hook()

    def wait_until(self, predicate: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(predicate)


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def engine(tiny_model_dir):
    eng = SteppedEngine(TorchEngineConfig(max_batch_size=8), tiny_model_dir)
    await eng.start()
    yield eng
    await eng.stop()


def greedy_reference(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def signal(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    loop.call_soon_threadsafe(event.set)


def _prefill(model, prompts: list[torch.Tensor]) -> tuple[PaddedBatchCache, torch.Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    valid = torch.zeros(len(prompts), length, dtype=torch.bool)
    pos = torch.zeros(len(prompts), length, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p):], valid[i, length - len(p):] = p, True
        pos[i, length - len(p):] = torch.arange(len(p))
    cache = PaddedBatchCache(model.config.num_hidden_layers)
    out = model(input_ids=ids, attention_mask=cache.extend(valid), position_ids=pos, **{cache_kwarg(model): cache},
                use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1]


@torch.inference_mode()
def test_cache_append_remove_trim_matches_unbatched(reference_model):
    """Decode logits of a batch that rows join and leave equal each sequence decoded alone."""
    model = reference_model
    torch.manual_seed(1)
    cache = PaddedBatchCache(model.config.num_hidden_layers, batch_capacity=4)
    seqs: list[torch.Tensor] = []
    logits = torch.empty(0, model.config.vocab_size)

    def add(prompts: list[torch.Tensor]) -> None:
        nonlocal logits, seqs
        part, part_logits = _prefill(model, prompts)
        cache.append(part)
        seqs, logits = seqs + prompts, torch.cat([logits, part_logits])

    def remove(rows: list[int]) -> None:
        nonlocal logits, seqs
        order = cache.remove_rows(rows)
        seqs, logits = [seqs[i] for i in order], logits[order]

    add([torch.randint(3, 80, (n,)) for n in (5, 9)])
    add([torch.randint(3, 80, (3,))])  # shorter newcomer: padded on its own side
    assert cache.seq_length == 9 and cache.batch_size == 3
    for step in range(45):  # past the preallocated column headroom, so buffers also grow
        nxt = logits.argmax(-1)
        seqs = [torch.cat([s, nxt[i:i + 1]]) for i, s in enumerate(seqs)]
        positions = torch.tensor([len(s) - 1 for s in seqs])
        mask = cache.extend(torch.ones(cache.batch_size, 1, dtype=torch.bool))
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions[:, None],
                       use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]
        reference = torch.stack([model(input_ids=s[None]).logits[0, -1] for s in seqs])
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        if step == 3:  # a newcomer longer than the batch: reallocates, the running rows get padding
            add([torch.randint(3, 80, (16,))])
            assert cache.batch_size == 4 and cache.seq_length == 16
        if step == 8:  # the longest row leaves: its leading columns were padding for every other row
            remove([3])
            assert cache.trim_leading_padding() > 0
            assert cache.seq_length == max(len(s) for s in seqs)
        if step == 12:  # a slightly longer newcomer: the running rows are extended left in place
            buffer = cache.layers[0].kbuf
            add([torch.randint(3, 80, (cache.seq_length + 2,))])
            assert cache.layers[0].kbuf is buffer
        if step == 20:
            remove([0, 1])
            assert cache.batch_size == 2
    remove([0, 1])
    assert cache.batch_size == 0
    add([torch.randint(3, 80, (4,))])  # an emptied cache takes new rows
    assert cache.batch_size == 1 and cache.seq_length == 4


async def test_staggered_greedy_equals_per_prompt_generate(engine, tokenizer, reference_model):
    assert isinstance(engine, Engine)
    loop = asyncio.get_running_loop()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [30, 6, 12, 25, 3]
    arrived = [asyncio.Event() for _ in range(3)]
    # the engine pauses after steps 3, 5 and 9 until the next prompt is queued
    for k, step in enumerate((3, 5, 9)):
        engine.hooks[step] = lambda k=k: (signal(loop, arrived[k]),
                                          engine.wait_until(lambda: len(engine._queue) > 0))

    def gen(i):
        params = SamplingParams(max_new_tokens=lengths[i], temperature=0.0, ignore_eos=True)
        return asyncio.create_task(engine.generate(prompts[i], params))

    tasks = [gen(0), gen(1)]
    for k in range(3):
        await arrived[k].wait()
        tasks.append(gen(k + 2))
    results = await asyncio.gather(*tasks)

    for i, result in enumerate(results):
        assert result.token_ids == greedy_reference(reference_model, prompts[i], lengths[i]), PROMPTS[i]
        assert result.finish_reason == "length"
        assert result.versions == [0] * lengths[i]
    sizes = [len(real) for real, _ in engine.trace]
    assert max(sizes) >= 3, "newcomers never joined a running batch"
    assert any(b < a for a, b in zip(sizes, sizes[1:], strict=False)), "finished rows never left"
    # no column is padding in every row: the cache is exactly as long as its longest row
    for real, length in engine.trace:
        assert length == (max(real) if real else 0)
    assert engine.stats().pending == 0 and engine.stats().running == 0


async def test_stop_token_eos_stop_string_and_length(tiny_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt = tokenizer.encode("the quick brown fox")
    probe = TorchEngine.from_model(model, tokenizer)
    await probe.start()
    full = await probe.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    await probe.stop()
    assert full.finish_reason == "length" and len(full.token_ids) == 40

    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    model.generation_config.eos_token_id = stop_token  # make that token the model's EOS
    engine = TorchEngine.from_model(model, tokenizer)
    await engine.start()
    try:
        greedy = {"temperature": 0.0, "max_new_tokens": 40}
        eos = await engine.generate(prompt, SamplingParams(**greedy))
        assert eos.finish_reason == "eos" and eos.token_ids == full.token_ids[: first + 1]

        by_id = await engine.generate(prompt, SamplingParams(**greedy, ignore_eos=True,
                                                             stop_token_ids=[full.token_ids[7]]))
        assert by_id.finish_reason == "stop"
        assert by_id.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[7]) + 1]

        text = tokenizer.decode(full.token_ids, skip_special_tokens=True)
        stop = text[10:12]
        cut = text.find(stop)
        need = next(k for k in range(1, 41) if stop in tokenizer.decode(full.token_ids[:k], skip_special_tokens=True))
        by_str = await engine.generate(prompt, SamplingParams(**greedy, ignore_eos=True, stop=["@@", stop]))
        assert by_str.finish_reason == "stop"
        assert by_str.text == text[:cut]
        assert by_str.token_ids == full.token_ids[:need]  # tokens kept up to and including the stop string

        short = await engine.generate(prompt, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]
        assert short.text == tokenizer.decode(full.token_ids[:3], skip_special_tokens=True)
    finally:
        await engine.stop()


async def test_logprobs_match_forward_at_temperature(engine, tokenizer, reference_model):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    settings = [(0.7, 1.0), (1.0, 1.0), (1.5, 0.9), (0.0, 1.0)]
    results = await asyncio.gather(*(
        engine.generate(p, SamplingParams(max_new_tokens=16, temperature=t, top_p=top_p, seed=i, ignore_eos=True))
        for i, (p, (t, top_p)) in enumerate(zip(prompts, settings, strict=True))))
    for prompt, (temperature, _), result in zip(prompts, settings, results, strict=True):
        ids = torch.tensor([prompt + result.token_ids])
        with torch.inference_mode():
            logits = reference_model(input_ids=ids).logits[0, len(prompt) - 1: -1]
        expected = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        expected = expected.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=1e-4)


async def test_seeded_sampling_is_reproducible_across_batches(engine, tokenizer):
    prompt = tokenizer.encode("seeded")
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = await engine.generate(prompt, params)
    crowd = await asyncio.gather(
        engine.generate(prompt, params),
        *(engine.generate(tokenizer.encode(p), SamplingParams(max_new_tokens=10, ignore_eos=True)) for p in PROMPTS))
    assert crowd[0].token_ids == alone.token_ids
    other = await engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=99, ignore_eos=True))
    assert other.token_ids != alone.token_ids


def perturbed(model_dir) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return {k: v + 0.2 * torch.randn_like(v) for k, v in state.items()}


async def test_between_requests_update_waits_for_running_rows(tiny_model_dir, tokenizer):
    engine = SteppedEngine(TorchEngineConfig(weight_update_mode="between_requests"), tiny_model_dir)
    await engine.start()
    try:
        loop = asyncio.get_running_loop()
        reached = asyncio.Event()
        engine.hooks[3] = lambda: (signal(loop, reached),
                                   engine.wait_until(lambda: bool(engine._updates) and len(engine._queue) > 0))
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        first = asyncio.create_task(engine.generate(tokenizer.encode("first"), params))
        await reached.wait()
        update = asyncio.create_task(engine.update_weights(perturbed(tiny_model_dir), version=5))
        second = asyncio.create_task(engine.generate(tokenizer.encode("second"), params))
        a, b = await asyncio.gather(first, second)
        await update
        assert a.versions == [0] * 12 and b.versions == [5] * 12
    finally:
        await engine.stop()


async def test_stats_count_pending_and_tokens(engine, tokenizer):
    loop = asyncio.get_running_loop()
    started, blocked, release = asyncio.Event(), asyncio.Event(), threading.Event()

    def hold() -> None:  # after the first step: wait for 5 more requests, then until released
        signal(loop, started)
        engine.wait_until(lambda: len(engine._queue) >= 5)
        signal(loop, blocked)
        release.wait()

    engine.hooks[1] = hold
    params = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    tasks = [asyncio.create_task(engine.generate(tokenizer.encode("x"), params))]
    await started.wait()
    tasks += [asyncio.create_task(engine.generate(tokenizer.encode(p), params)) for p in PROMPTS]
    await blocked.wait()
    stats = engine.stats()
    assert stats.pending == 6 and stats.running == 1
    release.set()
    await asyncio.gather(*tasks)
    stats = engine.stats()
    assert stats.pending == 0 and stats.running == 0 and stats.total_generated_tokens == 48
    assert stats.tokens_per_s > 0


async def test_two_hundred_concurrent_requests(tiny_model_dir, tokenizer):
    engine = TorchEngine(TorchEngineConfig(max_batch_size=64), tiny_model_dir)
    await engine.start()
    try:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, 17, (200,), generator=gen).tolist()
        results = await asyncio.gather(*(
            engine.generate(tokenizer.encode(PROMPTS[i % 5] * (1 + i % 3)),
                            SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True))
            for i, n in enumerate(lengths)))
        assert [len(r.token_ids) for r in results] == lengths
        assert all(len(r.logprobs) == len(r.versions) == len(r.token_ids) for r in results)
        assert all(lp <= 0.0 for r in results for lp in r.logprobs)
        assert engine.stats().pending == 0 and engine.stats().total_generated_tokens == sum(lengths)
    finally:
        await engine.stop()


async def test_cancelled_request_leaves_the_batch(engine, tokenizer):
    params = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
    long = asyncio.create_task(engine.generate(tokenizer.encode("long"), params))
    short = await engine.generate(tokenizer.encode("short"), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(short.token_ids) == 4
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long
    again = await engine.generate(tokenizer.encode("again"), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(again.token_ids) == 4
    assert engine.stats().pending == 0 and engine.stats().running == 0


async def test_a_request_cancelled_beside_running_ones_leaves_them_running(tiny_model_dir, tokenizer):
    """A client gone mid-call (a black-box agent's, a killed harness's) cancels its row while another row runs
    after it in the batch: the row is removed (the cache rows behind it move up) and the other finishes."""
    engine = SteppedEngine(TorchEngineConfig(max_batch_size=8), tiny_model_dir)
    await engine.start()
    go = threading.Event()
    try:
        loop = asyncio.get_running_loop()
        reached = asyncio.Event()
        engine.hooks[3] = lambda: (signal(loop, reached), go.wait(60))
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = {text: tokenizer.encode(text) for text in ("first", "second")}
        tasks = {text: asyncio.create_task(engine.generate(ids, params)) for text, ids in prompts.items()}
        await reached.wait()
        assert engine.stats().running == 2  # the engine holds after step 3, both rows running
        # cancel the request in row 0, so that the other row moves into its slot
        front = next(t for t, ids in prompts.items() if list(engine._batch.rows[0].seq.prompt_ids) == ids)
        tasks[front].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[front]
        go.set()
        out = await next(task for t, task in tasks.items() if t != front)
        assert len(out.token_ids) == 12 and len(out.versions) == 12
        assert engine.stats().pending == 0 and engine.stats().running == 0
    finally:
        go.set()
        await engine.stop()


async def test_errors_say_what_went_wrong(tiny_model_dir, tokenizer):
    engine = SteppedEngine(TorchEngineConfig(max_queued=1, dtype="bfloat16"), tiny_model_dir)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(EngineNotRunningError):
        await engine.generate([1, 2], params)
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_new_tokens=0)
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match="empty"):
            await engine.generate([], params)
        with pytest.raises(InvalidRequestError, match="max_position_embeddings"):
            await engine.generate([5] * 500, SamplingParams(max_new_tokens=20))
        with pytest.raises(WeightUpdateError, match="shape mismatch"):
            await engine.update_weights({"lm_head.weight": torch.zeros(3, 3)}, version=9)
        with pytest.raises(WeightUpdateError, match="unknown"):
            await engine.update_weights({"nope": torch.zeros(3)}, version=9)
        assert engine.version == 0
        # block the engine after its first step so the queue fills up
        loop = asyncio.get_running_loop()
        started, blocked, release = asyncio.Event(), asyncio.Event(), threading.Event()
        engine.hooks[1] = lambda: (signal(loop, started), engine.wait_until(lambda: len(engine._queue) >= 1),
                                   signal(loop, blocked), release.wait())
        running = asyncio.create_task(engine.generate([5, 6], params))
        await started.wait()
        queued = asyncio.create_task(engine.generate([5, 6], params))
        await blocked.wait()
        with pytest.raises(EngineOverloadedError):
            await engine.generate([5, 6], params)
        release.set()
        assert len((await running).token_ids) == 4  # bfloat16 weights generate too
        assert len((await queued).token_ids) == 4
    finally:
        await engine.stop()
    with pytest.raises(EngineNotRunningError):
        await engine.generate([1, 2], params)


async def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_model_dir):
    class FlakyEngine(TorchEngine):
        failures = 1

        def _decode_step(self) -> None:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("injected failure")
            super()._decode_step()

    engine = FlakyEngine(TorchEngineConfig(), tiny_model_dir)
    await engine.start()
    try:
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        with pytest.raises(EngineError, match="injected failure"):
            await engine.generate([5, 6, 7], params)
        assert engine.stats().pending == 0
        assert len((await engine.generate([5, 6, 7], params)).token_ids) == 5
    finally:
        await engine.stop()


async def test_engine_seed_controls_unseeded_requests(tiny_model_dir):
    async def sample(seed: int | None) -> list[int]:
        engine = TorchEngine(TorchEngineConfig(), tiny_model_dir, seed=seed)
        await engine.start()
        try:
            result = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=24, ignore_eos=True))
        finally:
            await engine.stop()
        return result.token_ids

    assert await sample(3) == await sample(3)
    assert await sample(None) != await sample(None)  # fresh engines do not share a sample stream


async def test_a_group_sharing_a_prompt_is_prefilled_once(engine, tokenizer, reference_model):
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    engine.hooks[1] = lambda: (signal(loop, started), engine.wait_until(lambda: len(engine._queue) >= 6))
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    blocker = asyncio.create_task(engine.generate(tokenizer.encode("wait"), greedy))
    await started.wait()
    prompts = [tokenizer.encode(p) for p in ("group", "group", "group", "other prompt", "other prompt", "x")]
    results = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    await blocker
    assert len(engine.trace[1][0]) == 7  # all six joined the blocker in one step
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == greedy_reference(reference_model, prompt, 10)
    sampled = await asyncio.gather(*(
        engine.generate(prompts[0], SamplingParams(max_new_tokens=16, seed=s, ignore_eos=True)) for s in range(4)))
    assert len({tuple(r.token_ids) for r in sampled}) == 4  # one prefill, still independent samples


async def test_sleep_keeps_requests_and_wake_resumes_them_exactly(tiny_model_dir, tokenizer):
    """Asleep (a colocated trainer steps), the engine decodes nothing and holds no KV cache; requests in flight
    are kept, and after the wake they finish with exactly the tokens and logprobs of an undisturbed run (their
    KV recomputed). DeviceShare drives it: every registered engine asleep for the turn, awake after."""
    from services.lib.colocation import DeviceShare

    engine = SteppedEngine(TorchEngineConfig(max_batch_size=8), tiny_model_dir)
    await engine.start()
    try:
        prompts = [tokenizer.encode(t) for t in ("sleep", "wake up", "keep going", "x")]
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        undisturbed = [await engine.generate(p, params) for p in prompts]
        share = DeviceShare()
        share.register(engine)
        start = engine.stats().total_generated_tokens
        loop = asyncio.get_running_loop()
        reached = asyncio.Event()  # the engine holds at a step mid-generation until the sleep is asked for
        engine.hooks[engine.step + 8] = lambda: (signal(loop, reached),
                                                 engine.wait_until(lambda: bool(engine._controls)))
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in prompts]
        await reached.wait()
        async with share.trainer_turn():
            assert engine.asleep and engine._batch.cache is None
            frozen = engine.stats().total_generated_tokens
            queued = asyncio.create_task(engine.generate(prompts[0], params))  # arrives while asleep
            await wait_for_async(lambda: engine.stats().pending == 5, 30, "the new request to be queued")
            assert not engine._has_work()  # the engine thread waits: nothing to decode while asleep
            assert engine.stats().total_generated_tokens == frozen
            assert not any(t.done() for t in tasks) and not queued.done()
        assert not engine.asleep and share.turns == 1 and share.failures == 0
        results = await asyncio.gather(*tasks)
        assert frozen - start < 4 * 40  # the sleep fell mid-generation
        for r, u in zip(results, undisturbed, strict=True):
            assert r.token_ids == u.token_ids
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(u.logprobs), atol=1e-4, rtol=1e-4)
        assert (await queued).token_ids == undisturbed[0].token_ids
    finally:
        await engine.stop()


async def test_a_failing_sleeper_does_not_stop_the_trainer_turn():
    from services.lib.colocation import DeviceShare

    class Broken:
        async def sleep(self) -> None:
            raise RuntimeError("no sleep mode here")

        async def wake_up(self) -> None:  # never called: it did not fall asleep
            raise AssertionError("woken without sleeping")

    share = DeviceShare()
    share.register(Broken())
    ran = False
    async with share.trainer_turn():
        ran = True
    assert ran and share.failures == 1 and share.turns == 0
