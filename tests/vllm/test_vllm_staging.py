"""A vLLM engine whose staging directory is too small for a weight update (a real 1 MiB tmpfs, as a
container's small default /dev/shm): the update fails naming the directory and the sizes, no partial file is
left, the engine keeps its version and serves on; with room (the tmpfs grown), the same update applies and
its staged file is gone afterwards."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from services.lib.engine.base import SamplingParams
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.staging import StagingError
from services.lib.engine.vllm_engine import VllmEngine


async def test_an_update_that_does_not_fit_the_staging_dir_is_refused_and_the_engine_serves_on(tiny_tmpfs,
                                                                                              loop_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loop_model_dir, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    engine = VllmEngine(VllmEngineConfig(dtype="float32", enforce_eager=True, kv_cache_gib=0.25,
                                         staging_dir=str(tiny_tmpfs)), loop_model_dir, seed=0)
    await engine.start()
    try:
        ids = [1, *engine.tokenizer.encode("12+34=", add_special_tokens=False)]
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        before = await engine.generate(ids, params)
        with pytest.raises(StagingError, match=rf"staging dir {tiny_tmpfs} has .* free .* but the weight update needs"):
            await engine.update_weights(state, version=1)
        assert os.listdir(tiny_tmpfs) == [] and engine.version == 0
        again = await engine.generate(ids, params)
        assert again.token_ids == before.token_ids and again.versions == [0] * 6

        subprocess.run(["mount", "-o", "remount,size=64m", str(tiny_tmpfs)], check=True)
        await engine.update_weights(state, version=1)
        assert engine.version == 1 and os.listdir(tiny_tmpfs) == []  # staged, read, removed
        assert (await engine.generate(ids, params)).versions == [1] * 6
    finally:
        await engine.stop()
