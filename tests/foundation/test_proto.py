"""Every proto Struct round-trips; strict decoding names the bad field."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import msgspec
import pytest

import proto
from proto import codec
from proto.envelope import Envelope
from proto.prompts import PromptTicket, Sampling
from proto.rollouts import Rollout, Turn
from proto.trajectories import GraderScore, ScoredTrajectory


def all_structs() -> list[type[msgspec.Struct]]:
    found = []
    for mod in pkgutil.iter_modules(proto.__path__):
        m = importlib.import_module(f"proto.{mod.name}")
        for _, obj in inspect.getmembers(m, inspect.isclass):
            if issubclass(obj, msgspec.Struct) and obj.__module__ == m.__name__ and obj is not Envelope:
                found.append(obj)
    return found


def sample_value(tp, depth=0):
    """A value of type ``tp`` built from its annotations, for round-trip tests."""
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return sample_value(args[0], depth)
    if tp is int:
        return 64
    if tp is float:
        return 1.5
    if tp is str:
        return "x"
    if tp is bool:
        return True
    if tp is bytes:
        return b"\x00\x01"
    if origin is typing.Literal:
        return args[0]
    if origin in (list,):
        return [sample_value(args[0], depth + 1)]
    if origin in (dict,):
        return {sample_value(args[0], depth + 1): sample_value(args[1], depth + 1)}
    if origin in (typing.Union, __import__("types").UnionType):
        non_none = [a for a in args if a is not type(None)]
        return sample_value(non_none[0], depth + 1)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return build(tp, depth + 1)
    return None


def build(cls, depth=0):
    hints = msgspec.structs.fields(cls)
    kwargs = {}
    for f in hints:
        v = sample_value(f.type, depth)
        if v is not None or f.required:
            kwargs[f.name] = v
    return cls(**kwargs)


@pytest.mark.parametrize("cls", all_structs(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_struct_round_trips(cls):
    msg = build(cls)
    assert codec.decode(codec.encode(msg), cls) == msg


def test_there_are_messages_for_the_loop():
    names = {c.__name__ for c in all_structs()}
    for needed in ["PromptTicket", "Rollout", "ScoredTrajectory", "Heartbeat", "DeadLetter", "MetricsReport"]:
        assert needed in names


def _rollout(**kw):
    base = dict(run_id="r1", task="addition", group_id="g", prompt_id="p", sample_index=0, group_size=2,
                prompt_ids=[1, 2], turns=[Turn(role="assistant", token_ids=[3, 4], logprobs=[-0.1, -0.2],
                                               versions=[3, 4])],
                finish_reason="eos", policy_version=3)
    base.update(kw)
    return Rollout(**base)


def test_envelope_defaults_are_unique_and_strict_decode_names_field():
    a, b = _rollout(), _rollout()
    assert a.msg_id != b.msg_id and a.created_at > 0 and a.schema == 1
    data = msgspec.msgpack.encode({**msgspec.to_builtins(a), "policy_version": "three"})
    with pytest.raises(codec.DecodeError) as e:
        codec.decode(data, Rollout)
    assert e.value.field == "$.policy_version"
    assert "policy_version" in str(e.value) and "int" in str(e.value)


def test_nested_field_error_names_path():
    t = ScoredTrajectory(run_id="r", rollout=_rollout(), reward=1.0, scores=[GraderScore(grader="exact", score=1.0)])
    raw = msgspec.to_builtins(t)
    raw["rollout"]["turns"][0]["logprobs"] = ["bad"]
    with pytest.raises(codec.DecodeError) as e:
        codec.decode(msgspec.msgpack.encode(raw), ScoredTrajectory)
    assert e.value.field == "$.rollout.turns[0].logprobs[0]"


def test_garbage_and_oversize_are_clear_errors():
    with pytest.raises(codec.DecodeError, match="not valid msgpack"):
        codec.decode(b"\xc1\xc1\xc1", PromptTicket)
    with pytest.raises(codec.DecodeError, match="exceeds"):
        codec.decode(b"\x00" * 100, PromptTicket, max_bytes=10)


def test_missing_required_field_is_named():
    data = msgspec.msgpack.encode({"run_id": "r", "task": "t"})
    with pytest.raises(codec.DecodeError) as e:
        codec.decode(data, PromptTicket)
    assert "missing required field" in str(e.value).lower()


def test_new_fields_with_defaults_keep_old_payloads_decoding():
    old = {"run_id": "r", "msg_id": "m", "created_at": 1.0, "schema": 1, "type": "prompt_ticket", "task": "t",
           "group_id": "g", "prompt_id": "p", "prompt_ids": [1], "group_size": 4, "policy_version": 0}
    t = codec.decode(msgspec.msgpack.encode(old), PromptTicket)
    assert t.sampling == Sampling() and t.is_eval is False


def test_rollout_helpers():
    r = _rollout(turns=[Turn(role="assistant", token_ids=[1], logprobs=[-1.0], versions=[5], text="a"),
                        Turn(role="tool", token_ids=[2, 3], text="b"),
                        Turn(role="assistant", token_ids=[4], logprobs=[-1.0], versions=[6], text="c")])
    assert r.completion_ids() == [1, 2, 3, 4]
    assert r.text() == "abc"
    assert r.min_version() == 5
