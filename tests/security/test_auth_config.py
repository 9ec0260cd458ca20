"""The generated credentials and configs: file modes, validity for nats-server, the permission matrix."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from proto.subjects import InvalidRunId
from services.launcher import auth, permissions
from services.runtime.config import NatsSection, load_tree
from services.runtime.natsd import find_nats_server

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "nats" / "rlbus-permissions.conf"
SERVICES = ["trainer", "rollout", "judge", "sandbox", "weightsync", "echo"]


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def who_may(kind: str, subject: str, run: str = "r1") -> set[str]:
    """The roles whose generated permissions allow ``kind`` (publish/subscribe) on ``subject``."""
    out = set()
    for role in permissions.ROLES:
        perms = permissions.flatten(permissions.grants_for(role, run, relay_scopes=("node-a",)))
        if any(matches(p, subject) for p in getattr(perms, kind)):
            out.add(role)
    return out


def check_config(path: Path, env: dict[str, str] | None = None) -> None:
    res = subprocess.run([find_nats_server(), "-c", str(path), "-t"], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_files_are_private_and_valid_for_nats_server(tmp_path):
    bundle = auth.generate_auth(tmp_path, SERVICES, run_id="r1", max_payload=8 << 20)
    d = Path(bundle.directory)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("auth.conf", "server.conf", "credentials.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    assert set(bundle.credentials) == {*SERVICES, "launcher", "admin"}
    passwords = [c.password for c in bundle.credentials.values()]
    assert len(set(passwords)) == len(passwords) and all(len(p) >= 48 for p in passwords)
    assert all(p in (d / "auth.conf").read_text() for p in passwords)
    check_config(Path(bundle.server_config))
    assert auth.load_auth(tmp_path) == bundle


def test_reuse_keeps_passwords_and_rewrites_permissions(tmp_path):
    first = auth.generate_auth(tmp_path, ["trainer"], run_id="r1")
    again = auth.generate_auth(tmp_path, ["trainer", "judge"], run_id="r1")
    assert again.for_role("trainer").password == first.for_role("trainer").password
    assert "judge-r1" in Path(again.include).read_text()
    fresh = auth.generate_auth(tmp_path, ["trainer"], run_id="r1", reuse=False)
    assert fresh.for_role("trainer").password != first.for_role("trainer").password


def test_bad_inputs_are_refused_with_a_clear_message(tmp_path):
    with pytest.raises(auth.AuthError, match="'frobnicator'"):
        auth.generate_auth(tmp_path, ["frobnicator"])
    with pytest.raises(auth.AuthError, match="relay scope 'main'"):
        auth.generate_auth(tmp_path, ["rollout"], relay_scopes=["main"])
    with pytest.raises(InvalidRunId):
        auth.generate_auth(tmp_path, ["rollout"], run_id="a.b")
    with pytest.raises(auth.AuthError, match="does not exist"):
        auth.load_auth(tmp_path / "nowhere")


def test_overrides_give_a_service_its_login(tmp_path):
    bundle = auth.generate_auth(tmp_path, ["judge"], run_id="r1", private_inboxes=False)
    creds = bundle.for_role("judge")
    tree = load_tree(None, env={}, overrides=creds.nats_overrides())
    assert tree["nats"] == {"user": "judge-r1", "password": creds.password}
    assert creds.url("nats://127.0.0.1:4222") == f"nats://judge-r1:{creds.password}@127.0.0.1:4222"
    private = auth.generate_auth(tmp_path, ["judge"], run_id="r1").for_role("judge")
    assert private.inbox_prefix == "_INBOX_judge"
    if "inbox_prefix" in NatsSection.__struct_fields__:
        assert load_tree(None, env={}, overrides=private.nats_overrides())["nats"]["inbox_prefix"] == "_INBOX_judge"
    else:
        with pytest.raises(auth.AuthError, match="inbox_prefix"):
            private.nats_overrides()


def test_every_service_subject_is_pinned_to_the_run():
    for role in permissions.ROLES:
        if role in permissions.ALWAYS:
            continue
        perms = permissions.flatten(permissions.grants_for(role, "r1", relay_scopes=("node-a",)))
        for subj in perms.publish + perms.subscribe:
            tokens = subj.split(".")
            if tokens[0] == "rlbus":
                assert tokens[1] == "r1", (role, subj)
            if tokens[0] == "$KV":
                assert tokens[2] == "r1", (role, subj)
            if subj.startswith("$JS.API.CONSUMER.DURABLE.CREATE."):
                assert tokens[-1].endswith("-r1"), (role, subj)


@pytest.mark.parametrize(("kind", "subject", "roles"), [
    ("publish", "rlbus.r1.prompts", {"trainer"}),
    ("publish", "rlbus.r1.trajectories", {"judge"}),
    ("publish", "rlbus.r1.rollouts", {"rollout"}),
    ("publish", "rlbus.r1.outcomes", {"trainer"}),
    ("publish", "rlbus.r1.weights.announce.main", {"trainer"}),
    ("publish", "rlbus.r1.weights.announce.node-a", {"weightsync"}),
    ("publish", "$KV.rlbus_weights_main.r1.latest", {"trainer"}),
    ("publish", "$KV.rlbus_weights_node-a.r1.latest", {"weightsync"}),
    ("publish", "$O.rlbus_weight_blobs_main.C.x", {"trainer"}),
    ("publish", "$O.rlbus_weight_blobs_node-a.C.x", {"weightsync"}),
    ("publish", "$KV.rlbus_weights_main.r1.v.0000000001", {"trainer", "weightsync"}),
    ("publish", "$KV.rlbus_weights_main.r1.bcast.g.rank.1", {"trainer", "rollout"}),
    ("publish", "rlbus.r1.sandbox.api.create", {"rollout", "judge"}),
    ("publish", "rlbus.r1.sandbox.events.abc-1", {"sandbox"}),
    ("publish", "$JS.API.STREAM.UPDATE.TRAJECTORIES", {"launcher"}),
    ("publish", "$JS.API.STREAM.DELETE.TRAJECTORIES", {"launcher"}),
    ("publish", "$JS.API.CONSUMER.MSG.NEXT.TRAJECTORIES.trainer-r1", {"trainer", "launcher"}),
    ("publish", "$JS.ACK.TRAJECTORIES.trainer-r1.1.2.3.4.0", {"trainer", "launcher"}),
    ("publish", "$JS.API.DIRECT.GET.TRAJECTORIES", {"admin", "launcher"}),
    # the run bucket: each role only its own keys (the gang record cannot be overwritten by another role)
    ("publish", "$KV.rlbus_runs.r1.gang", {"launcher"}),
    ("publish", "$KV.rlbus_runs.r1.gang.trainer", {"trainer", "launcher"}),
    ("publish", "$KV.rlbus_runs.r1.gang.judge", {"judge", "launcher"}),
    ("publish", "$KV.rlbus_runs.r1.state", {"trainer", "launcher"}),
    ("publish", "$KV.rlbus_runs.r1.anything", {"launcher"}),
    ("subscribe", "rlbus.r1.trajectories", {"admin", "launcher"}),
    ("subscribe", "rlbus.r1.sandbox.api.create", {"sandbox", "admin", "launcher"}),
    ("subscribe", "_INBOX_trainer.abc", {"trainer"}),
    ("subscribe", "_INBOX.abc", {"admin", "launcher"}),
])
def test_permission_matrix(kind, subject, roles):
    assert who_may(kind, subject) == roles


def test_deploy_example_is_generated_from_the_table_and_valid(tmp_path):
    assert EXAMPLE.read_text() == auth.render_example(), (
        "deploy/nats/rlbus-permissions.conf is stale: python -m services.launcher.auth > deploy/nats/rlbus-permissions.conf")
    (tmp_path / EXAMPLE.name).write_text(EXAMPLE.read_text())
    wrapper = tmp_path / "server.conf"
    wrapper.write_text(f'include "{EXAMPLE.name}"\n')  # include paths are relative to the including file
    check_config(wrapper, {f"RLBUS_{role.upper()}_PASSWORD": f"pw-{role}" for role in permissions.ROLES})
    assert "tls {" in EXAMPLE.read_text()
