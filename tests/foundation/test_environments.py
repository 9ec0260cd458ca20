"""The launcher runs a service configured with a vLLM engine under an environment that has vLLM."""

from __future__ import annotations

import sys

import pytest

from services.launcher import environments
from services.launcher.environments import MissingEnvironment, needs_vllm, python_for
from services.launcher.runfile import RunFile
from services.lib.engine.config import vllm_available


def run_file(tree: dict) -> RunFile:
    return RunFile.from_tree(tree)


VLLM_TREE = run_file({"services": {"rollout": {"engine": {"type": "vllm"}}, "trainer": {}}})


def test_only_parts_with_a_vllm_engine_need_it():
    assert needs_vllm("rollout", VLLM_TREE) and needs_vllm("trainer+rollout", VLLM_TREE)
    assert not needs_vllm("trainer", VLLM_TREE) and not needs_vllm("judge", VLLM_TREE)
    assert not needs_vllm("rollout", run_file({"services": {"rollout": {"engine": {"type": "torch"}}}}))
    assert not needs_vllm("rollout", run_file({}))
    judged = run_file({"services": {"judge": {"graders": {"coding": [
        {"type": "reward"}, {"type": "llm_judge", "rubric": "Correct?", "judge": {"type": "vllm", "model": "smollm2"}}]}}}})
    assert needs_vllm("judge", judged) and not needs_vllm("judge", run_file({"services": {"judge": {"graders": {}}}}))
    assert python_for("trainer", VLLM_TREE) == sys.executable
    # vLLM's weight transfer runs vLLM's trainer-side engine in the trainer's process
    transfer = run_file({"weights": {"type": "vllm"}, "services": {"rollout": {"engine": {"type": "vllm"}}}})
    assert needs_vllm("trainer", transfer) and not needs_vllm("judge", transfer)


def test_the_vllm_environment_is_found_or_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    if vllm_available():
        pytest.skip("this environment has vLLM itself: every service runs here (the case tested is its absence)")
    monkeypatch.setattr(environments, "REPO", tmp_path)  # a checkout without .venv-vllm
    monkeypatch.delenv(environments.VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(MissingEnvironment, match=r"\./rlbus setup vllm"):
        python_for("rollout", VLLM_TREE)
    monkeypatch.setenv(environments.VLLM_PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(MissingEnvironment, match="not an executable Python"):
        python_for("rollout", VLLM_TREE)
    monkeypatch.setenv(environments.VLLM_PYTHON_ENV, sys.executable)
    assert python_for("rollout", VLLM_TREE) == sys.executable
    monkeypatch.delenv(environments.VLLM_PYTHON_ENV)
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    assert python_for("rollout", VLLM_TREE) == str(venv / "python")


def test_auto_engine_runs_the_rollout_under_vllm_for_models_of_its_size(tmp_path, monkeypatch):
    """``engine = { type = "auto" }`` (the default) needs vLLM's environment for a >= 50 M model only, and
    only where such an environment exists (else the rollout serves with the torch engine, saying why)."""
    if vllm_available():
        pytest.skip("this environment has vLLM itself: every service runs here (the case tested is its absence)")
    monkeypatch.setattr(environments, "REPO", tmp_path)
    monkeypatch.delenv(environments.VLLM_PYTHON_ENV, raising=False)
    big = run_file({"model": {"name": "smollm2"}})
    small = run_file({"model": {"name": "tiny-addition"}, "services": {"rollout": {"engine": {"type": "auto"}}}})
    raised = run_file({"model": {"name": "smollm2"},
                       "services": {"rollout": {"engine": {"type": "auto", "vllm_min_params_m": 500}}}})
    assert not needs_vllm("rollout", big)  # no vLLM environment: auto falls back to torch, no error
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    assert needs_vllm("rollout", big) and python_for("rollout", big) == str(venv / "python")
    assert needs_vllm("trainer+rollout", big) and not needs_vllm("trainer", big)
    assert not needs_vllm("rollout", small) and not needs_vllm("rollout", raised)
    assert not needs_vllm("rollout", run_file({"model": {"name": "smollm2"},
                                               "services": {"rollout": {"engine": {"type": "torch"}}}}))
