"""A colocated trainer hands its memory back to the engines around each step (services/lib/colocation.py).

On this CPU machine the logic is what is tested, with real torch and a real torch engine: which tensors move
(weights, buffers, optimiser state; gradients dropped), that parameters keep their identity and every value
survives the round trip (a step after it equals a step without it), the order of a turn (engines asleep and
the trainer's memory on its device for the step; the memory handed back before the engines wake), and that a
colocated engine starts only once the trainer has handed its memory back. What it frees on a GPU
(``empty_cache``, vLLM's start-up check, sleep level 2) is not verified here: there is no GPU."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from services.launcher.runfile import RunFile
from services.lib.colocation import DeviceShare, HostOffload
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.model_io import load_policy
from services.runtime.config import ConfigError


def trained(model_dir) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The policy after one AdamW step (so the optimiser has state to move)."""
    model, _ = load_policy(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.arange(1, 9).unsqueeze(0) % model.config.vocab_size
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients kept: a release must drop them


def everything(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        out.update({f"o/{i}/{k}": v.clone() for k, v in state.items()})
    return out


def test_release_and_reclaim_move_weights_and_optimizer_state_and_keep_every_value(loop_model_dir):
    model, opt = trained(loop_model_dir)
    twin_model, twin_opt = copy.deepcopy(model), None
    twin_opt = torch.optim.AdamW(twin_model.parameters(), lr=1e-3)
    twin_opt.load_state_dict(opt.state_dict())
    before = everything(model, opt)
    params = list(model.parameters())
    where = {id(p): p.data_ptr() for p in params}
    moments = {(i, k): v.data_ptr() for i, s in enumerate(opt.state.values()) for k, v in s.items()}

    # the host and the "device" are both the CPU here: what moves is still copied into new storage
    memory = HostOffload([model, None], [opt], device="cpu")
    memory.release()
    assert memory.on_host
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    weight_bytes = sum(p.numel() * p.element_size() for p in params) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert memory.moved_bytes == weight_bytes + state_bytes  # each tensor once (tied weights too)
    assert all(p.data_ptr() != where[id(p)] for p in params)  # every weight moved
    assert all(v.data_ptr() != moments[(i, k)] for i, s in enumerate(opt.state.values()) for k, v in s.items())
    assert all(p.grad is None for p in params)
    assert list(model.parameters()) == params  # the same Parameter objects: the optimiser still holds them
    assert [p for g in opt.param_groups for p in g["params"]] == params
    memory.release()  # a second release is a no-op
    memory.reclaim()
    assert not memory.on_host
    after = everything(model, opt)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # training goes on exactly as if nothing had moved
    step(model, opt)
    step(twin_model, twin_opt)
    mine, twin = model.state_dict(), twin_model.state_dict()
    assert mine.keys() == twin.keys() and all(torch.equal(mine[k], twin[k]) for k in mine)


async def test_a_turn_sleeps_engines_then_reclaims_and_hands_back_before_they_wake(loop_model_dir):
    share = DeviceShare()
    model, opt = trained(loop_model_dir)
    memory = HostOffload([model], [opt], device="cpu")
    engine = TorchEngine(TorchEngineConfig(enable_sleep_mode=True), loop_model_dir)
    await engine.start()
    try:
        # the engine's start waits for the colocated trainer to have loaded and handed its memory back
        started = asyncio.Event()

        async def start_engine() -> None:
            async with share.engine_start(with_trainer=True):
                started.set()

        starting = asyncio.create_task(start_engine())
        done, _ = await asyncio.wait({starting}, timeout=0.5)
        assert not done and not started.is_set()  # no trainer yet
        await share.set_trainer(memory)
        await starting
        assert started.is_set() and memory.on_host  # handed back before the engine started
        share.register(engine)

        seen = {}
        async with share.trainer_turn():
            seen = {"engine_asleep": engine.asleep, "trainer_on_host": memory.on_host}
            step(model, opt)  # the learner step, on the device
        assert seen == {"engine_asleep": True, "trainer_on_host": False}
        assert memory.on_host and not engine.asleep and share.turns == 1 and share.failures == 0

        # no engine to make room for: the trainer's memory comes back for the step and stays
        share.unregister(engine)
        async with share.trainer_turn():
            assert not memory.on_host
        assert not memory.on_host
    finally:
        await engine.stop()


async def test_a_cpu_trainer_moves_nothing_but_still_lets_the_engine_start():
    share = DeviceShare()
    await share.set_trainer(None)  # the trainer on CPU (or many ranks): nothing moves
    async with share.engine_start(with_trainer=True):
        pass
    async with share.trainer_turn():
        pass
    assert share.turns == 0


def _check(weights: dict, layout: dict, sleep_level: int, lora: bool = False) -> list[str]:
    tree = {"weights": weights, "launcher": {"services": layout},
            "services": {"rollout": {"engine": {"type": "vllm", "enable_sleep_mode": True,
                                                "sleep_level": sleep_level}},
                         "trainer": {"lora": {"r": 4}} if lora else {}}}
    return RunFile.from_tree(tree).check()


def test_sleep_level_2_needs_a_full_update_after_every_step():
    colocated = {"trainer+rollout": 1, "judge": 1}
    assert _check({"type": "inproc"}, colocated, 2) == []
    with pytest.raises(ConfigError, match=r"services\.rollout\.engine\.sleep_level is 2.*'store'"):
        _check({"type": "store"}, {"trainer": 1, "rollout": 1}, 2)
    with pytest.raises(ConfigError, match="with LoRA"):
        _check({"type": "inproc"}, colocated, 2, lora=True)
    assert _check({"type": "store"}, {"trainer": 1, "rollout": 1}, 1) == []
