"""Fixtures for rollout tests: a tiny random Llama model with a character tokenizer, built locally."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,:;!?+-*/=()[]<>'\"#_\n")


def build_tiny_model(path: Path, *, seed: int = 0, max_positions: int = 512) -> Path:
    """Save a 2-layer, hidden-64 Llama model (``max_positions`` of context) and a char-level tokenizer
    (vocab = specials + chars) to ``path``."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny model directory shared by the session (read-only by convention)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path) -> LlamaForCausalLM:
    """The tiny model loaded with plain transformers, EOS disabled, for reference generations."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model
