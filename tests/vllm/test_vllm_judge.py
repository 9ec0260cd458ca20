"""An LLM judge on vLLM: `judge = { type = "vllm" }` in an llm_judge grader runs vLLM in the judge process
and grades a real rollout (the tiny model is no good judge: the point is that the path works end to end)."""

from __future__ import annotations

from proto.rollouts import Rollout, Turn
from services.tasks.grader_specs import LlmJudgeSpec, VllmJudgeModel
from services.tasks.graders import GraderFactory
from services.tasks.judge_backends import EngineJudgeBackend, JudgeCache


async def test_an_llm_judge_grades_with_a_vllm_engine(loop_model_dir):
    spec = LlmJudgeSpec(rubric="Is the sum right?", max_tokens=8, prefill="",
                        judge=VllmJudgeModel(model=str(loop_model_dir), dtype="float32", kv_cache_gib=0.25,
                                             max_num_seqs=8))
    factory = GraderFactory(sandboxes=None, cache=JudgeCache())
    backend = factory.backend(spec.judge)
    assert isinstance(backend, EngineJudgeBackend) and backend.identity.startswith("vllm:")
    (grader,) = factory.build("addition", [spec])
    rollout = Rollout(run_id="r", task="addition", group_id="g", prompt_id="p", sample_index=0, group_size=1,
                      prompt_ids=[1, 2], prompt_text="12+34=", finish_reason="eos", policy_version=0,
                      turns=[Turn(role="assistant", token_ids=[5], logprobs=[-1.0], versions=[0], text="46")])
    try:
        score = await grader.grade(rollout, task=None)
        # the tiny model writes no usable score: the grader says so instead of inventing one
        assert 0.0 <= score.score <= 1.0
        assert score.error or score.explanation
        text = await backend.complete([{"role": "user", "content": "12+34="}], max_tokens=4)
        assert isinstance(text, str)  # the vLLM engine answered through the judge's chat path
    finally:
        await factory.close()
