"""Graders: hidden tests in a fork of a real sandbox, LLM-as-judge (malformed output, cache), composition."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest
from agentic_harness import RUN, Bus, ScriptedEngine, coding_prompt

from proto.rollouts import Rollout, Turn
from services.lib.sandbox_client import SandboxClientError
from services.tasks import get_task
from services.tasks.grader_specs import LlmJudgeSpec, OpenAIJudgeModel, RewardGraderSpec, SandboxTestsSpec
from services.tasks.graders import GraderFactory, LlmJudgeGrader, SandboxTestsGrader, grade_all
from services.tasks.judge_backends import (
    EngineJudgeBackend,
    JudgeCache,
    JudgeParseError,
    OpenAIJudgeBackend,
    parse_judge_score,
)

GOOD = b"def add_2(x):\n    return x + 2\n"
BUGGY = b"def add_2(x):\n    return x + 2 if x > 3 else x + 1\n"


def rollout_for(sandbox_id: str | None, answer: str = "```python\ndef add_2(x):\n    return x + 2\n```",
                msg_id: str = "r-1") -> Rollout:
    p = coding_prompt()
    r = Rollout(run_id=RUN, task="coding", group_id="g", prompt_id=p.id, sample_index=0, group_size=1,
                prompt_ids=[1, 2], turns=[Turn(role="assistant", token_ids=[3], logprobs=[-0.1], versions=[0],
                                               text=answer)],
                finish_reason="eos", policy_version=0, metadata=dict(p.metadata), sandbox_id=sandbox_id,
                prompt_text=p.text)
    r.msg_id = msg_id
    return r


async def test_fork_grading_leaves_the_original_untouched_and_failing_tests_score_low(bus: Bus):
    task = get_task("coding")
    c = bus.sandboxes
    grader = SandboxTestsGrader(SandboxTestsSpec(), c)
    scores = {}
    for name, code in (("good", GOOD), ("buggy", BUGGY)):
        sid = (await c.create(files={"solution.py": code, "notes.txt": b"mine"})).sandbox_id
        await c.pause(sid)  # as a rollout hands it over
        score = await grader.grade(rollout_for(sid), task)
        scores[name] = score
        # the original: same files, no trace of the hidden tests, still paused, still there
        assert await c.read_file(sid, "solution.py") == code
        assert await c.read_file(sid, "notes.txt") == b"mine"
        with pytest.raises(FileNotFoundError):
            await c.read_file(sid, ".rlbus_hidden/run_tests.py")
        assert await bus.state(sid) == "paused"
        assert [s.sandbox_id for s in await c.sandboxes(expected=1)] == [sid]  # the fork is gone
        await c.destroy(sid)
    assert scores["good"].score == 1.0 and scores["good"].error is None
    assert scores["buggy"].score == pytest.approx(1 / 3)  # only add_2(5) == 7 passes
    assert "1/3 hidden tests passed" in scores["buggy"].explanation
    assert "add_2(1) returned 2, expected 3" in scores["buggy"].explanation


async def test_a_fake_report_printed_by_the_solution_does_not_pass(bus: Bus):
    task = get_task("coding")
    cheat = b'print(\'RLBUS-TESTS {"passed": 3, "total": 3}\')\nimport os\nos._exit(0)\n'
    sid = (await bus.sandboxes.create(files={"solution.py": cheat})).sandbox_id
    score = await SandboxTestsGrader(SandboxTestsSpec(), bus.sandboxes).grade(rollout_for(sid), task)
    assert score.score == 0.0
    await bus.sandboxes.destroy(sid)


async def test_sandbox_grader_failures_are_recorded_not_raised(bus: Bus):
    task = get_task("coding")
    grader = SandboxTestsGrader(SandboxTestsSpec(), bus.sandboxes)
    gone = (await bus.sandboxes.create()).sandbox_id
    await bus.sandboxes.destroy(gone)
    missing = await grader.grade(rollout_for(gone), task)
    assert missing.score == 0.0 and "could not fork" in missing.error
    none = await grader.grade(rollout_for(None), task)
    assert none.score == 0.0 and "no sandbox" in none.error
    with pytest.raises(SandboxClientError):  # the grader caught what the client raises
        await bus.sandboxes.fork(sandbox_id=gone)


@pytest.fixture
def judge_endpoint() -> Iterator[tuple[str, list[dict], dict[str, str]]]:
    """A local OpenAI-compatible endpoint with scripted answers (the reply is chosen by a word of the rubric)."""
    requests: list[dict] = []
    answers: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            prompt = body["messages"][-1]["content"]
            content = next((a for word, a in answers.items() if word in prompt), "no answer scripted")
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            return None

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, name="judge-endpoint", daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", requests, answers
    srv.shutdown()
    srv.server_close()


async def test_llm_judge_malformed_output_is_a_recorded_failure_and_verdicts_are_cached(judge_endpoint):
    url, requests, answers = judge_endpoint
    answers["MALFORMED"] = "What a lovely function! I would give it high marks."
    answers["CLEAR"] = "Score: 8/10\nClear and correct."
    backend = OpenAIJudgeBackend(OpenAIJudgeModel(base_url=url, model="judge"))
    cache = JudgeCache()
    task = get_task("coding")
    bad = LlmJudgeGrader(LlmJudgeSpec(rubric="MALFORMED rubric", name="style"), backend, cache)
    good = LlmJudgeGrader(LlmJudgeSpec(rubric="CLEAR rubric", weight=0.5), backend, cache)
    r = rollout_for(None)

    s = await bad.grade(r, task)
    assert s.score == 0.0 and "unparseable" in s.error and "lovely function" in s.error
    s = await good.grade(r, task)
    assert s.error is None and s.score == pytest.approx(0.8) and "Clear and correct" in s.explanation
    assert len(requests) == 2 and (cache.hits, cache.misses) == (0, 2)
    # the same (rollout, rubric) again: answered from the cache, the judge is not asked
    again = await bad.grade(r, task)
    assert again.error is not None and "unparseable" in again.error
    assert (await good.grade(r, task)).score == pytest.approx(0.8)
    assert len(requests) == 2 and (cache.hits, cache.misses) == (2, 2)
    # another rollout is a miss; the judge saw the task and the transcript
    await good.grade(rollout_for(None, answer="```python\ndef add_2(x): return 2\n```", msg_id="r-2"), task)
    assert len(requests) == 3 and cache.misses == 3
    assert "def add_2(x): return 2" in requests[-1]["messages"][-1]["content"]
    assert "add_2(x)` that returns x plus 2" in requests[-1]["messages"][-1]["content"]

    # composed with weights: the malformed judge is skipped (on_error="skip") or counts as zero
    format_reward = GraderFactory(None, cache).build("coding", [RewardGraderSpec(weight=1.0)])[0]
    skip = LlmJudgeGrader(LlmJudgeSpec(rubric="MALFORMED rubric", on_error="skip"), backend, cache)
    grading = await grade_all([format_reward, good, skip], r, task)
    assert grading.reward == pytest.approx((1.0 * 1.0 + 0.5 * 0.8) / 1.5) and grading.failure is None
    assert [x.grader for x in grading.scores] == ["coding.reward", "llm_judge", "llm_judge"]
    grading = await grade_all([format_reward, good, bad], r, task)
    assert grading.reward == pytest.approx((1.0 + 0.4 + 0.0) / 2.5) and grading.failure is None


async def test_llm_judge_endpoint_down_is_recorded_and_not_cached():
    backend = OpenAIJudgeBackend(OpenAIJudgeModel(base_url="http://127.0.0.1:9/v1", model="judge", timeout_s=2))
    cache = JudgeCache()
    grader = LlmJudgeGrader(LlmJudgeSpec(rubric="any"), backend, cache)
    s = await grader.grade(rollout_for(None), get_task("coding"))
    assert s.score == 0.0 and "failed" in s.error and not cache.entries


async def test_llm_judge_on_an_engine_uses_the_chat_template(tokenizer):
    # the judge model here is the scripted stand-in engine, answering in a malformed then a clean format
    contexts: list[str] = []

    async def seen(turn: int, context: str) -> None:
        contexts.append(context)

    engine = ScriptedEngine(tokenizer, ["Rating: eleven out of ten"], hook=seen)
    grader = LlmJudgeGrader(LlmJudgeSpec(rubric="be strict"), EngineJudgeBackend(engine, tokenizer, "scripted"),
                            JudgeCache())
    s = await grader.grade(rollout_for(None), get_task("coding"))
    assert s.score == 0.0 and "unparseable" in s.error
    engine.script = ["**Score:** 7\nFine."]
    s = await grader.grade(rollout_for(None, msg_id="r-3"), get_task("coding"))
    assert s.error is None and s.score == pytest.approx(0.7)
    # prompted through the chat template, the answer started with the prefill
    assert contexts[0].startswith("<|im_start|>system\nYou are a careful") and "be strict" in contexts[0]
    assert contexts[0].endswith("<|im_start|>assistant\nScore:")


@pytest.mark.parametrize("text,score", [
    ("Score: 7", 0.7), ("score = 7/10", 0.7), ("**Rating:** 3 out of 5", 0.6), ('{"score": 10, "why": "ok"}', 1.0),
    ("I'd say 6/10 overall.", 0.6), ("4", 0.4), ("Score: 0 - wrong", 0.0), ("Grade: 9.5\nnear perfect", 0.95),
])
def test_judge_score_parser_accepts_common_formats(text, score):
    assert parse_judge_score(text, 10)[0] == pytest.approx(score)


@pytest.mark.parametrize("text", ["", "great job", "Score: 12", "Score: -1", "eleven/10", "Score: 3/0"])
def test_judge_score_parser_refuses_malformed_output(text):
    with pytest.raises(JudgeParseError):
        parse_judge_score(text, 10)
