"""deploy/skypilot loaded by SkyPilot's own loader (``skypilot`` in .venv-deploy; no cloud access): the job
group has its three tasks, every rlbus command in them exists in the CLI, every service of the examples runs
somewhere in the group, and the NATS logins of env.sh are users of the permissions file."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.deploy.deploy_tools import (
    DEPLOY,
    ROOT,
    check_command,
    deploy_python,
    launcher_services,
    rlbus_lines,
)

SKY = DEPLOY / "skypilot"
LOAD = """
import json, sys
from sky.utils import dag_utils
out = []
for path in sys.argv[1:]:
    dag = dag_utils.load_dag_from_yaml(path)
    out.append({"path": path, "job_group": dag.is_job_group(), "name": dag.name, "tasks": [
        {"name": t.name, "num_nodes": t.num_nodes, "run": t.run, "setup": t.setup, "envs": dict(t.envs),
         "accelerators": sorted({str(r.accelerators) for r in t.resources})} for t in dag.tasks]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    files = sorted(SKY.glob("*.yaml"))
    out = subprocess.run([deploy_python(), "-c", LOAD, *map(str, files)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return {d["path"].rsplit("/", 1)[-1]: d for d in json.loads(out.stdout.strip().splitlines()[-1])}


def test_the_job_group_has_a_trainer_node_an_engine_fleet_and_a_sandbox_pool(loaded):
    group = loaded["rlbus-job-group.yaml"]
    assert group["job_group"] and group["name"] == "rlbus"
    tasks = {t["name"]: t for t in group["tasks"]}
    assert set(tasks) == {"trainer", "engines", "sandboxes"}
    assert tasks["engines"]["num_nodes"] >= 2 and tasks["sandboxes"]["num_nodes"] >= 2
    assert all(a != "None" for t in ("trainer", "engines") for a in tasks[t]["accelerators"])
    assert tasks["sandboxes"]["accelerators"] == ["None"]


def test_commands_exist_and_every_example_service_runs_in_the_group(loaded):
    started: set[str] = set()
    for task in loaded["rlbus-job-group.yaml"]["tasks"]:
        lines = rlbus_lines(task["run"])
        assert lines, task["name"]
        for argv in lines:
            argv = [a.replace("$RLBUS_EXAMPLE", "addition") for a in argv]
            args = check_command(argv)
            if args.command == "service":
                started.add(args.name)
    for example in ("addition", "coding"):
        missing = launcher_services(ROOT / "examples" / f"{example}.toml") - started
        assert not missing, f"{example}: no task runs {missing}"
    engines = loaded["engines.yaml"]["tasks"][0]
    assert [check_command(a).name for a in rlbus_lines(engines["run"])] == ["rollout"]


def test_env_sh_logs_each_role_in_as_a_user_of_the_permissions_file(loaded):
    permissions = (DEPLOY / "nats" / "rlbus-permissions.conf").read_text()
    env_sh = (SKY / "env.sh").read_text()
    roles = re.search(r"for r in ([a-z ]+); do", env_sh).group(1).split()
    assert set(re.findall(r'user: "(\w+)"', permissions)) <= set(roles)
    for task in loaded["rlbus-job-group.yaml"]["tasks"]:
        for role in re.findall(r"source deploy/skypilot/env.sh (\w+)", task["run"]):
            assert f'user: "{role}"' in permissions, role
