"""Pure codec tests: the full layout is safetensors, deltas rebuild bit-identically."""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

from services.lib.weights.encoding import (
    CodecError,
    apply_delta,
    decode_full,
    encode_delta,
    encode_full,
    split,
)
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_layout_is_safetensors(dtype):
    state = make_state(1, dtype)
    full = encode_full(state)
    # any safetensors reader opens our bytes
    assert_bit_identical(safetensors.torch.load(bytes(full.buf)), state)
    # and our zero-copy decoder agrees
    assert_bit_identical(decode_full(full.buf, full.tensors), state)


def test_full_layout_keeps_special_values():
    t = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45], dtype=torch.float32)
    full = encode_full({"x": t})
    assert_bit_identical(decode_full(full.buf, full.tensors), {"x": t})


@pytest.mark.parametrize("frac", [0.05, 0.6], ids=["sparse", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_round_trip_bit_identical(dtype, frac):
    a = make_state(2, dtype)
    b = perturb(a, frac, seed=3)
    fa, fb = encode_full(a), encode_full(b)
    blob, entries = encode_delta(fa.buf, fb.buf, fa.tensors)
    assert sum(e.nnz for e in entries) > 0
    assert any(e.dense for e in entries) == (frac > 0.25)
    assert len(blob) < len(fb.buf)
    buf = bytearray(fa.buf)
    undo = apply_delta(buf, blob, entries)
    assert buf == fb.buf
    undo.undo(buf)
    assert buf == fa.buf


def test_delta_of_identical_versions_is_empty():
    fa = encode_full(make_state(4))
    blob, entries = encode_delta(fa.buf, bytearray(fa.buf), fa.tensors)
    assert all(e.nnz == 0 for e in entries)
    buf = bytearray(fa.buf)
    apply_delta(buf, blob, entries)
    assert buf == fa.buf


def test_delta_with_wrong_counts_is_refused():
    a = make_state(5)
    fa, fb = encode_full(a), encode_full(perturb(a, 0.1, seed=6))
    blob, entries = encode_delta(fa.buf, fb.buf, fa.tensors)
    entries[0].nnz += 1
    with pytest.raises(CodecError):
        apply_delta(bytearray(fa.buf), blob, entries)


def test_split_covers_blob():
    parts = split(10, 4)
    assert parts == [(0, 4), (4, 4), (8, 2)]
    assert split(0, 4) == [(0, 0)]
