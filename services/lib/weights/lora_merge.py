"""LoRA adapters as weight versions: the one wire form, and the one merge every engine uses.

A LoRA run sends only its adapter tensors per weight version. They travel as an ordinary state dict, so
every transport (store anchors and deltas, broadcast, inproc) carries them unchanged:

* ``<base weight name>.lora_A``: ``A`` (r × in) of the adapted linear layer whose weight is
  ``<base weight name>`` (e.g. ``model.layers.0.self_attn.q_proj.weight``);
* ``<base weight name>.lora_B``: ``B`` (out × r);
* ``__lora__``: a uint8 tensor holding the JSON of :class:`AdapterMeta` (``r``, ``alpha``, the target
  module names). Integers are never cast by a transport's ``dtype = "bf16"``, so ``alpha`` arrives exact.

An engine keeps the base of every adapted weight and loads ``W = W_base + (B A) · alpha / r`` (computed
in float32, then cast to the engine's dtype): the same sum peft's ``merge_adapter`` forms, so an engine
given an adapter version holds the weights an engine given the merged full state would.
:class:`AdapterMerger` is that bookkeeping; the torch engine feeds it its own weights as the base, the
vLLM engine the safetensors of its model directory (:func:`read_tensors`).

No peft here: engines (the vLLM environment included) merge with plain torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: key of the metadata tensor that marks a state dict as an adapter version
ADAPTER_KEY = "__lora__"
FORMAT = "rlbus-lora-v1"
_A, _B = ".lora_A", ".lora_B"


class AdapterFormatError(ValueError):
    """An adapter version is malformed or does not fit the model (the message names the tensor)."""


@dataclass(frozen=True)
class AdapterMeta:
    """What an engine needs besides the tensors: rank, scale numerator, the adapted module names."""

    r: int
    alpha: float
    target_modules: list[str] = field(default_factory=list)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def to_tensor(self) -> torch.Tensor:
        data = json.dumps({"format": FORMAT, "r": self.r, "alpha": self.alpha,
                           "target_modules": list(self.target_modules)}, sort_keys=True).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> AdapterMeta:
        try:
            meta = json.loads(bytes(t.detach().to("cpu", torch.uint8).reshape(-1).tolist()))
        except (ValueError, UnicodeDecodeError) as e:
            raise AdapterFormatError(f"{ADAPTER_KEY}: not the JSON of an adapter's settings ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise AdapterFormatError(f"{ADAPTER_KEY}: format {meta.get('format') if isinstance(meta, dict) else meta!r}"
                                     f" is not {FORMAT!r}")
        try:
            r, alpha = int(meta["r"]), float(meta["alpha"])
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterFormatError(f"{ADAPTER_KEY}: r and alpha must be numbers ({e})") from None
        if r < 1 or alpha <= 0:
            raise AdapterFormatError(f"{ADAPTER_KEY}: r = {r}, alpha = {alpha}: need r >= 1 and alpha > 0")
        return cls(r=r, alpha=alpha, target_modules=[str(m) for m in meta.get("target_modules", [])])


def is_adapter(state: Mapping[str, object]) -> bool:
    """Whether ``state`` is an adapter version (carries :data:`ADAPTER_KEY`)."""
    return ADAPTER_KEY in state


def pack(pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], meta: AdapterMeta) -> dict[str, torch.Tensor]:
    """The wire form of ``{base weight name: (A, B)}``."""
    out: dict[str, torch.Tensor] = {}
    for name, (a, b) in pairs.items():
        out[name + _A], out[name + _B] = a, b
    out[ADAPTER_KEY] = meta.to_tensor()
    return out


def unpack(state: Mapping[str, torch.Tensor]) -> tuple[AdapterMeta, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``(meta, {base weight name: (A, B)})`` of an adapter version; shapes checked against each other."""
    if ADAPTER_KEY not in state:
        raise AdapterFormatError(f"not an adapter version: no {ADAPTER_KEY} tensor")
    meta = AdapterMeta.from_tensor(state[ADAPTER_KEY])
    a_of = {k[: -len(_A)]: v for k, v in state.items() if k.endswith(_A)}
    b_of = {k[: -len(_B)]: v for k, v in state.items() if k.endswith(_B)}
    stray = [k for k in state if k != ADAPTER_KEY and not k.endswith((_A, _B))]
    if stray:
        raise AdapterFormatError(f"adapter version holds tensors that are not adapters: {stray[:3]}")
    if a_of.keys() != b_of.keys():
        odd = sorted(a_of.keys() ^ b_of.keys())
        raise AdapterFormatError(f"adapter version lacks the A or B half of {odd[:3]}")
    pairs = {}
    for name, a in a_of.items():
        b = b_of[name]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != meta.r or b.shape[1] != meta.r:
            raise AdapterFormatError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                                     f"(r, in) and (out, r) with r = {meta.r}")
        pairs[name] = (a, b)
    return meta, pairs


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + (B A) · scaling`` computed in float32 on ``base``'s device, returned in ``base``'s dtype."""
    delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
    return (base.to(torch.float32) + delta * scaling).to(base.dtype)


class AdapterMerger:
    """Keeps the base of every adapted weight; turns each adapter version into the full tensors to load.

    ``read_base(names)`` returns the base tensors of ``names`` (called once per name, the first time an
    adapter names it); ``shapes`` are the model's weight shapes, to check adapters against.
    """

    def __init__(self, read_base: Callable[[list[str]], dict[str, torch.Tensor]],
                 shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.read_base = read_base
        self.shapes = shapes
        self.base: dict[str, torch.Tensor] = {}

    def check(self, state: Mapping[str, torch.Tensor]) -> tuple[AdapterMeta, dict[str, tuple[torch.Tensor,
                                                                                          torch.Tensor]]]:
        """Unpack ``state`` and check every adapted weight exists with a matching shape (nothing changes)."""
        meta, pairs = unpack(state)
        for name, (a, b) in pairs.items():
            if name not in self.shapes:
                raise AdapterFormatError(f"adapter for unknown weight {name!r}: send an adapter of this model")
            shape = tuple(self.shapes[name])
            if len(shape) != 2 or (b.shape[0], a.shape[1]) != shape:
                raise AdapterFormatError(f"{name}: adapter (B {tuple(b.shape)}, A {tuple(a.shape)}) does not fit "
                                         f"the weight's shape {shape}")
        return meta, pairs

    def merged(self, state: Mapping[str, torch.Tensor], include: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """Full tensors of every adapted weight (base + B A · alpha / r), plus the base of ``include``
        (weights an engine must reload with them, e.g. the other parts of a fused layer)."""
        meta, pairs = self.check(state)
        wanted = [n for n in dict.fromkeys([*pairs, *include]) if n not in self.base]
        if wanted:
            self.base.update({k: v.detach().clone() for k, v in self.read_base(wanted).items()})
        missing = [n for n in dict.fromkeys([*pairs, *include]) if n not in self.base]
        if missing:
            raise AdapterFormatError(f"no base weights for {missing[:3]}")
        out = {name: merge(self.base[name], a, b, meta.scaling) for name, (a, b) in pairs.items()}
        for name in include:
            out.setdefault(name, self.base[name])
        return out

    def rebase(self, full: Mapping[str, torch.Tensor]) -> None:
        """A full (non-adapter) version was loaded: its tensors are the new base of the weights it names."""
        for name in [n for n in full if n in self.base]:
            self.base[name] = full[name].detach().to(self.base[name].device, self.base[name].dtype).clone()


def read_tensors(model_dir: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` from the safetensors file(s) of a Hugging Face model directory (CPU)."""
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    wanted = list(names)
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {n: "model.safetensors" for n in wanted}
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        if n in where:
            by_file.setdefault(where[n], []).append(n)
    for file, file_names in by_file.items():
        with safe_open(str(root / file), framework="pt") as f:
            have = set(f.keys())
            out.update({n: f.get_tensor(n) for n in file_names if n in have})
    return out
