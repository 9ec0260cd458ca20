"""Shared helpers of the weightsync tests: model-like state dicts and bit-exact comparison."""

from __future__ import annotations

import torch


def make_state(seed: int = 0, dtype: torch.dtype = torch.float32, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small model-like state dict with mixed shapes and dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64 * scale, 32, generator=g).to(dtype),
        "layers.0.attn.q.weight": torch.randn(32, 32, generator=g).to(dtype),
        "layers.0.attn.q.bias": torch.randn(32, generator=g).to(dtype),
        "layers.0.norm.weight": torch.ones(32, dtype=dtype),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(16, generator=g) > 0.5,
        "empty": torch.empty(0, 4, dtype=dtype),
    }


def perturb(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy where about ``frac`` of each floating tensor's elements changed (like a small RL step)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        t = t.clone()
        if t.is_floating_point() and t.numel():
            m = torch.rand(t.shape, generator=g) < frac
            t[m] = (t[m].float() + 0.01 * torch.randn(int(m.sum()), generator=g)).to(t.dtype)
        out[k] = t
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        x, y = a[k].contiguous().reshape(-1), b[k].contiguous().reshape(-1)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{k} differs"
