"""deploy/k8s rendered offline: ``kubectl kustomize`` renders each overlay and the Kueue example, the output
validates against the Kubernetes schemas (kubernetes-validate, schema version pinned), the containers'
commands and probes exist in the CLI, their RLBUS__ variables are config keys of the run file's services,
KEDA scales on real consumers, and the NATS Helm values give what the services need. Custom resources (KEDA,
Kueue) have no schema in kubernetes-validate: their fields that matter are checked here instead."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
import yaml

from proto import catalog
from services.launcher.permissions import inbox_prefix
from services.runtime.weights_config import ObjStoreConfig
from tests.deploy.deploy_tools import (
    DEPLOY,
    DEPLOY_VENV,
    K8S_SCHEMA_VERSION,
    check_command,
    check_env,
    launcher_services,
    read_env_file,
    tool,
)

K8S = DEPLOY / "k8s"
RUN_FILE = K8S / "base" / "run.toml"
RUN = tomllib.loads(RUN_FILE.read_text())
TARGETS = ["overlays/cpu-local", "overlays/gpu", "kueue"]
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


def render(target: str) -> list[dict]:
    kubectl = tool("kubectl", "install it: apt-get install kubectl (./rlbus does as root)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(path) -> subprocess.CompletedProcess:
    exe = tool(str(DEPLOY_VENV / "bin" / "kubernetes-validate"), "run ./rlbus setup deploy (creates .venv-deploy)")
    return subprocess.run([exe, "-k", K8S_SCHEMA_VERSION, "--strict", str(path)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {t: render(t) for t in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_against_the_kubernetes_schemas(target, rendered, tmp_path):
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(rendered[target]))
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    builtin = [d for d in rendered[target] if "." not in d["apiVersion"].split("/")[0] or
               d["apiVersion"].startswith(("apps/", "batch/"))]
    passed = re.findall(r"passed for resource", result.stdout + result.stderr)
    assert len(passed) == len(builtin) > 0, result.stdout + result.stderr


def test_the_validator_rejects_a_broken_manifest(tmp_path):
    """The validation above can fail: a misspelt field in a Deployment is refused."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replica": 2, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert validate(path).returncode != 0


def containers(docs: list[dict]):
    for d in docs:
        if d["kind"] in WORKLOADS:
            spec = d["spec"]["template"]["spec"] if d["kind"] != "Job" else d["spec"]["template"]["spec"]
            for c in spec["containers"]:
                yield d, c


@pytest.mark.parametrize("target", TARGETS)
def test_commands_probes_logins_and_env_keys(target, rendered):
    services = set()
    for d, c in containers(rendered[target]):
        args = check_command(c["args"])
        env = {e["name"]: e.get("value", "node-1") for e in c.get("env", [])}
        role = env["RLBUS__NATS__USER"]
        secret = next(e for e in c["env"] if e["name"] == "RLBUS__NATS__PASSWORD")["valueFrom"]["secretKeyRef"]
        assert secret["key"] == f"RLBUS_{role.upper()}_PASSWORD", d["metadata"]["name"]
        if args.command == "provision":
            assert role == "launcher"
            continue
        services.add(args.name)
        assert role == args.name and env["RLBUS__NATS__INBOX_PREFIX"] == inbox_prefix(role), d["metadata"]["name"]
        check_env(args.name, RUN_FILE, env)
        if d["kind"] != "Job":
            for probe in ("readinessProbe", "livenessProbe"):
                check_command(c[probe]["exec"]["command"][1:], service=args.name)
    if target.startswith("overlays"):
        assert services == launcher_services(RUN_FILE), services


def test_the_run_file_is_valid_for_every_service_it_lists():
    for service in launcher_services(RUN_FILE):
        check_env(service, RUN_FILE, {})


def test_shapes_per_role(rendered):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/cpu-local"]}
    assert ("StatefulSet", "trainer") in docs and ("DaemonSet", "weightsync-relay") in docs
    for role in ("rollout", "judge", "sandbox", "weightsync"):
        assert ("Deployment", role) in docs, role
    sandbox = docs[("Deployment", "sandbox")]["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert "SYS_ADMIN" in sandbox["capabilities"]["add"] and sandbox["capabilities"]["drop"] == ["ALL"]
    assert not sandbox.get("privileged")
    assert sandbox["seccompProfile"]["type"] == "Unconfined"
    trainer = docs[("StatefulSet", "trainer")]["spec"]
    assert trainer["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    gpu = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/gpu"]}
    for key in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
        limits = gpu[key]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1, key


def _shm(pod: dict) -> tuple[str, str]:
    """(the mount's volume medium, its size limit) of the container's /dev/shm, or ("", "") without one."""
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
    if "/dev/shm" not in mounts:
        return "", ""
    vol = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    return vol.get("emptyDir", {}).get("medium", ""), vol.get("emptyDir", {}).get("sizeLimit", "")


@pytest.mark.parametrize("target", TARGETS)
def test_trainer_and_rollout_get_a_memory_dev_shm_of_a_stated_size(target, rendered):
    # vLLM stages weight updates in /dev/shm and NCCL uses it; a pod's default is 64 MiB
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in rendered[target]
            if d["kind"] in WORKLOADS and d["metadata"]["name"] in ("trainer", "rollout")}
    if target == "kueue":
        pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in rendered[target] if d["kind"] == "Job"}
    assert pods, target
    expected = {"overlays/cpu-local": "4Gi", "overlays/gpu": "32Gi", "kueue": "32Gi"}[target]
    for name, pod in pods.items():
        assert _shm(pod) == ("Memory", expected), (target, name)


def test_keda_scales_rollout_and_judge_on_their_consumers_lag(rendered):
    run_id = RUN["run"]["id"]
    docs = rendered["overlays/cpu-local"]
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    scaled = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"rollout", "judge"}
    consumers = {"rollout": catalog.ROLLOUT_PROMPTS.for_run(run_id), "judge": catalog.JUDGE_ROLLOUTS.for_run(run_id)}
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "nats-jetstream"
        meta = trigger["metadata"]
        assert (meta["stream"], meta["consumer"]) == (consumers[name].stream, consumers[name].durable), name
        assert int(meta["lagThreshold"]) > 0 and meta["natsServerMonitoringEndpoint"].endswith(":8222")


def test_kueue_admits_the_trainer_group_as_one_workload(rendered):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered["kueue"]}
    job = docs[("Job", "trainer")]
    queue = job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    assert ("LocalQueue", queue) in docs
    assert docs[("LocalQueue", queue)]["spec"]["clusterQueue"] in {n for k, n in docs if k == "ClusterQueue"}
    assert job["spec"]["suspend"] is True  # Kueue unsuspends it on admission
    c = job["spec"]["template"]["spec"]["containers"][0]
    world = int(next(e["value"] for e in c["env"] if e["name"] == "RLBUS__SERVICES__TRAINER__DEVICES__WORLD_SIZE"))
    assert c["resources"]["requests"]["nvidia.com/gpu"] == world  # the whole rank group or nothing


def test_nats_helm_values_give_the_services_what_they_need(rendered):
    values = yaml.safe_load((K8S / "nats" / "values.yaml").read_text())
    cfg = values["config"]
    assert cfg["cluster"]["enabled"] and cfg["cluster"]["replicas"] >= RUN["nats"]["replicas"] == 3
    assert cfg["jetstream"]["enabled"] and cfg["jetstream"]["fileStore"]["enabled"]
    assert cfg["merge"]["max_payload"] >= ObjStoreConfig().message_bytes + 1024
    permissions = (DEPLOY / "nats" / "rlbus-permissions.conf").read_text()
    needed = set(re.findall(r"password: \$(\w+)", permissions))
    assert needed <= set(values["container"]["env"]), needed - set(values["container"]["env"])
    assert needed <= set(read_env_file(K8S / "base" / "nats-credentials.env"))
    env = next(d for d in rendered["overlays/cpu-local"] if d["kind"] == "ConfigMap"
               and d["metadata"]["name"] == "rlbus-env")["data"]
    assert len(env["RLBUS__NATS__URL"].split(",")) == cfg["cluster"]["replicas"]
