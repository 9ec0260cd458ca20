"""Models by Hub id, from a local directory laid out as a Hugging Face cache entry (never a download)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.runtime.natsd import free_port
from services.tasks.models import ModelSpecError, hub_id, model_params, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, tiny_model_dir, monkeypatch):
    """``rlbus-test/tiny`` in a Hugging Face cache: refs/main -> snapshots/<commit> (the tiny model's files)."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--rlbus-test--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_are_told_from_paths_and_builtins(tmp_path, monkeypatch):
    assert hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_hub in ("tiny-addition", "/abs/dir", "./rel/dir", "a/b/c", "name"):
        assert hub_id(not_hub) is None, not_hub
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert hub_id("org/local") is None  # an existing directory wins


def test_a_cached_hub_model_resolves_offline_and_loads(hf_cache, tiny_model_dir):
    snapshot = resolve_model("rlbus-test/tiny")
    assert snapshot == hf_cache / "models--rlbus-test--tiny" / "snapshots" / COMMIT
    assert resolve_model("rlbus-test/tiny@main") == snapshot
    assert resolve_model("rlbus-test/tiny", revision=COMMIT) == snapshot
    model = AutoModelForCausalLM.from_pretrained(snapshot, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    assert tokenizer.decode(tokenizer.encode("12+34=", add_special_tokens=False)) == "12+34="
    assert sum(p.numel() for p in model.parameters()) == model_params(str(tiny_model_dir))
    # the engine choice reads the cached snapshot's config, and says "unknown" for what is not cached
    assert model_params("rlbus-test/tiny") == model_params(str(tiny_model_dir))
    assert model_params("rlbus-test/absent") is None


def test_not_cached_offline_names_the_id(hf_cache):
    with pytest.raises(ModelSpecError, match="model 'rlbus-test/absent' is not in the Hugging Face cache .*"
                                             "HF_HUB_OFFLINE is set.*hf download rlbus-test/absent"):
        resolve_model("rlbus-test/absent")
    with pytest.raises(ModelSpecError, match="'rlbus-test/tiny@v9' is not in the Hugging Face cache"):
        resolve_model("rlbus-test/tiny@v9")


def test_online_but_unreachable_uses_the_cache_or_names_the_id(hf_cache):
    """The Hub endpoint is a closed local port: cached ids resolve, others fail naming the id (no network)."""
    script = ("import sys\nfrom services.tasks.models import resolve_model, ModelSpecError\n"
              "print(resolve_model('rlbus-test/tiny'))\n"
              "try:\n    resolve_model('rlbus-test/absent')\nexcept ModelSpecError as e:\n    print('ERROR', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].endswith(f"models--rlbus-test--tiny/snapshots/{COMMIT}")
    assert lines[1].startswith("ERROR model 'rlbus-test/absent' is not in the Hugging Face cache")
    assert "could not be reached" in lines[1]
