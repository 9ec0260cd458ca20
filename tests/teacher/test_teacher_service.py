"""The teacher service on a real nats-server with locally built tiny models: it answers requests with the
teacher's logprob of every completion token (the same numbers as a direct forward pass), answers bad requests
with the reason and goes on serving, and stops start-up naming the keys when its tokenizer is not the
student's. The judge's client gets a rollout's teacher logprobs from it, and with no teacher running gives up
after ``distill.wait_s`` with the reason."""

from __future__ import annotations

import asyncio

import nats
import pytest
import torch

from proto import catalog, codec
from proto.rollouts import Rollout, Turn
from proto.teacher import TeacherReply, TeacherRequest, TeacherSequence
from services.judge.teacher_client import TeacherUnavailable, teacher_logprobs
from services.launcher import registry
from services.lib.model_io import load_policy, save_policy, sequence_logprobs
from services.runtime import service
from services.runtime.config import ConfigError, DistillSection, load_service_config
from services.tasks.tiny_model import build_char_tokenizer, build_tiny_model
from services.teacher.service import TeacherService
from tests.conftest import run_file

RUN = "teacherrun"


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A larger model with the student's tokenizer, and one whose tokenizer has a token more."""
    root = tmp_path_factory.mktemp("teachers")
    tok = build_char_tokenizer()
    save_policy(build_tiny_model(tok, seed=1, hidden_size=192), tok, root / "same")
    other = build_char_tokenizer()
    other.add_tokens(["#"])
    save_policy(build_tiny_model(other, seed=2), other, root / "other")
    return root / "same", root / "other"


def _loaded(tmp_path, nats_url, student, teacher):
    cfg = run_file(tmp_path, student, run_id=RUN, nats_url=nats_url, trainer={},
                   extra=f'[services.teacher]\nmodel = "{teacher}"\nmax_batch_size = 2\nmax_sequences = 8\n')
    return load_service_config("teacher", registry.load("teacher")[0], cfg)


async def _ask(nc, req: TeacherRequest) -> TeacherReply:
    msg = await nc.request(catalog.TEACHER_REQUESTS.subject(RUN), codec.encode(req), timeout=60)
    return codec.decode(msg.data, TeacherReply)


@pytest.mark.slow
async def test_the_teacher_scores_sampled_tokens_over_the_bus(nats_url, tmp_path, loop_model_dir, teachers):
    same, _ = teachers
    stop = asyncio.Event()
    served = asyncio.create_task(service.serve("teacher", registry.load("teacher")[1],
                                               _loaded(tmp_path, nats_url, loop_model_dir, same), "teacher-0",
                                               stop=stop))
    nc = await nats.connect(nats_url)
    try:
        seqs = [TeacherSequence(prompt_ids=[1, 5, 6], completion_ids=[7, 8, 2]),
                TeacherSequence(prompt_ids=[1, 9], completion_ids=[10]),
                TeacherSequence(prompt_ids=[1, 4, 4, 4], completion_ids=[5, 6, 7, 8, 9])]  # 3 > max_batch_size 2
        deadline = asyncio.get_running_loop().time() + 120
        while True:  # the service subscribes once its model is loaded: until then no responder answers
            try:
                reply = await _ask(nc, TeacherRequest(run_id=RUN, sequences=seqs, temperature=0.7))
                break
            except nats.errors.NoRespondersError:
                assert asyncio.get_running_loop().time() < deadline and not served.done(), "the teacher never served"
                await asyncio.wait({served}, timeout=0.5)
        assert reply.error == "" and reply.teacher == str(same)
        assert [len(r) for r in reply.logprobs] == [3, 1, 5]
        model, _ = load_policy(same)
        with torch.no_grad():
            direct, _ = sequence_logprobs(model, [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs],
                                          temperature=0.7)
        for k, row in enumerate(reply.logprobs):
            assert torch.allclose(torch.tensor(row), direct[k, : len(row)], atol=1e-5)
            assert all(v < 0 for v in row)

        # bad requests are answered with the reason; the service goes on
        bad = await _ask(nc, TeacherRequest(run_id=RUN, sequences=[TeacherSequence(prompt_ids=[1],
                                                                                   completion_ids=[999])]))
        assert bad.logprobs == [] and "token id 999, outside the teacher's vocabulary" in bad.error
        many = await _ask(nc, TeacherRequest(run_id=RUN, sequences=seqs * 3))
        assert "9 sequences, over services.teacher.max_sequences 8" in many.error
        other_run = await _ask(nc, TeacherRequest(run_id="another", sequences=seqs))
        assert "request of run 'another'" in other_run.error
        again = await _ask(nc, TeacherRequest(run_id=RUN, sequences=seqs[1:2], temperature=0.7))
        assert again.error == "" and again.logprobs[0] == pytest.approx(reply.logprobs[1])

        # the judge's client: a rollout's tokens (assistant and observation turns, in order) at temperature 1
        rollout = _rollout([1, 5, 6], [[7, 8], [9], [2]])
        (got,) = await teacher_logprobs(nc, RUN, [rollout], DistillSection(enabled=True, wait_s=30))
        with torch.no_grad():
            direct, _ = sequence_logprobs(model, [[1, 5, 6]], [[7, 8, 9, 2]])
        assert torch.allclose(torch.tensor(got), direct[0], atol=1e-5)
    finally:
        stop.set()
        assert await asyncio.wait_for(served, 60) == 0
        await nc.close()


def _rollout(prompt: list[int], turns: list[list[int]]) -> Rollout:
    return Rollout(run_id=RUN, task="addition", group_id="g", prompt_id="p", sample_index=0, group_size=1,
                   prompt_ids=prompt, finish_reason="eos", policy_version=0,
                   turns=[Turn(role="assistant" if k % 2 == 0 else "tool", token_ids=ids, text="x")
                          for k, ids in enumerate(turns)])


async def test_with_no_teacher_running_the_judge_gives_up_after_wait_s_with_the_reason(nats_url):
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(TeacherUnavailable, match=r"no teacher logprobs after 1.5s \(\d+ tries; distill.wait_s\): "
                                                     r"no teacher service is running"):
            await teacher_logprobs(nc, RUN, [_rollout([1, 5], [[6]])], DistillSection(enabled=True, wait_s=1.5))
    finally:
        await nc.close()


def test_a_teacher_with_another_tokenizer_stops_start_up_naming_the_keys(tmp_path, loop_model_dir, teachers):
    _, other = teachers
    svc = TeacherService(_loaded(tmp_path, "nats://127.0.0.1:1", loop_model_dir, other))
    with pytest.raises(ConfigError, match=r"config keys services.teacher.model and model.name: the teacher's "
                                          r"tokenizer differs from the student's \(20 vs 19 tokens; only the "
                                          r"teacher's: \['#'\]\)"):
        svc.load()


def test_a_teacher_service_without_a_model_stops_start_up(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id=RUN, trainer={})
    with pytest.raises(ConfigError, match="config key services.teacher.model: name the teacher model"):
        TeacherService(load_service_config("teacher", registry.load("teacher")[0], cfg))
