"""The typed run file: every shipped run file loads through it and passes its cross-section rules, every key
is documented (docs/CONFIG.md is generated from the structs and must be current), the resolved file holds
every default, and no service sees another's section."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest

from services.launcher import config_doc
from services.launcher.runfile import RunFile
from services.runtime.config import ConfigError, Loaded

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted([*REPO.glob("examples/*.toml"), REPO / "deploy" / "k8s" / "base" / "run.toml"])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_run_file_loads_and_names_its_model_once(path):
    runfile = RunFile.load(path, env={})
    runfile.check()
    text = path.read_text()
    if "[services.trainer]" in text:  # a training run names its model and task once, in the shared sections
        assert "[model]" in text and "[task]" in text, path
    for section in ("[services.trainer]", "[services.rollout]", "[services.judge]"):
        body = text.split(section, 1)[1].split("\n[", 1)[0] if section in text else ""
        assert not [line for line in body.splitlines() if line.split("=")[0].strip() in ("model", "task",
                                                                                         "transport")], path


def test_the_configuration_reference_is_current():
    assert (REPO / "docs" / "CONFIG.md").read_text() == config_doc.render(), \
        "docs/CONFIG.md is stale: run `rlbus config doc` (or .venv/bin/python -m services.launcher.cli config doc)"


def _structs(cls: type, seen: set[type]) -> None:
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls, include_extras=True)

    def inner(t: typing.Any) -> None:
        for v in config_doc._variants(t):
            _structs(v, seen)
        for a in typing.get_args(config_doc._strip(t)):
            inner(a)

    for f in msgspec.inspect.type_info(cls).fields:  # type: ignore[attr-defined]
        inner(hints[f.name])


def test_every_key_has_a_comment_for_the_reference():
    seen: set[type] = set()
    _structs(RunFile, seen)
    missing = [f"{cls.__module__}.{cls.__qualname__}.{name}" for cls in seen
               for name, text in config_doc.field_comments(cls).items() if not text]
    assert not missing, "fields without a #: comment (docs/CONFIG.md needs one): " + ", ".join(sorted(missing))
    assert len(seen) > 30  # the walk reached the nested sections (engines, stores, graders, ...)


def test_the_resolved_file_holds_every_default_and_reads_back(tmp_path):
    runfile = RunFile.load(REPO / "examples" / "addition.toml", env={}, overrides=["services.rollout.max_tickets=7"])
    resolved = runfile.resolved()
    assert resolved["services"]["rollout"]["max_tickets"] == 7  # what the file set
    assert resolved["services"]["judge"]["user_code"]["timeout_s"] == 10.0  # a default it did not
    assert resolved["weights"]["type"] == "store" and resolved["model"]["name"] == "tiny-addition"
    assert RunFile.from_tree(json.loads(json.dumps(resolved))) == runfile


def test_config_show_prints_defaults_and_check_names_the_bad_key(tmp_path):
    cli = [sys.executable, "-m", "services.launcher.cli", "config"]
    shown = subprocess.run([*cli, "show", "addition", "--json"], capture_output=True, text=True, cwd=REPO)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["services"]["trainer"]["group_timeout_s"] == 300.0
    text = subprocess.run([*cli, "show", "addition"], capture_output=True, text=True, cwd=REPO).stdout
    assert "[model]\nname = \"tiny-addition\"" in text and "[services.judge.user_code]" in text
    bad = tmp_path / "bad.toml"
    bad.write_text('[launcher]\nservices = { trainer = 1, rollout = 3 }\n[weights]\ntype = "broadcast"\n'
                   "world_size = 2\n")
    checked = subprocess.run([*cli, "check", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert checked.returncode == 2 and "weights.world_size is 2" in checked.stderr and "set it to 4" in checked.stderr
    bad.write_text("[services.rollout]\nmax_tikets = 3\n")
    checked = subprocess.run([*cli, "check", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert checked.returncode == 2 and "services.rollout.max_tikets: unknown key" in checked.stderr


def test_a_service_sees_the_shared_sections_and_only_its_own():
    runfile = RunFile.load(REPO / "examples" / "dataset.toml", env={})
    judge = runfile.loaded("judge")
    assert isinstance(judge, Loaded) and judge.task.name == "dataset" and judge.task.options["path"]
    assert judge.service is runfile.services.judge and judge.model.name == "tiny-addition"
    assert "tree" not in Loaded.__struct_fields__  # no raw tree to walk another service's section in
    with pytest.raises(ConfigError, match="no section"):
        runfile.loaded("nosuch")


def test_no_service_module_walks_the_raw_config():
    """Only the launcher's run-file module decodes sections; a service reads its typed Loaded."""
    offenders = []
    for path in (REPO / "services").rglob("*.py"):
        text = path.read_text()
        if path.parent.name != "launcher" and ('tree.get("services")' in text or ".cfg.tree" in text):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders
