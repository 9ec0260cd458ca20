"""Placement and multi-node trainers in the deploy files: compose's GPU override, the gpu overlay's requests
and the 2-node trainer manifests (Kubernetes, SkyPilot) against the run files they deploy, read with the
same typed placement the launcher applies (services/launcher/placement.py). SkyPilot's own loader reads the
2-node job group in tests/deploy/test_skypilot.py (every file of deploy/skypilot)."""

from __future__ import annotations

import re
import subprocess
import tomllib

import yaml

from services.launcher.placement import Layout
from services.launcher.runfile import RunFile
from tests.deploy.deploy_tools import (
    DEPLOY,
    DEPLOY_VENV,
    K8S_SCHEMA_VERSION,
    ROOT,
    check_command,
    check_env,
    rlbus_lines,
    tool,
)

K8S = DEPLOY / "k8s"


def render(target: str) -> list[dict]:
    kubectl = tool("kubectl", "install it: apt-get install kubectl (./rlbus does as root)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def container(docs: list[dict], kind: str, name: str) -> dict:
    doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)
    return doc["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def test_compose_gpu_override_requests_what_the_gpu_example_places():
    base = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    override = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())["services"]
    runfile = RunFile.load(ROOT / "examples" / "gpu.toml", env={})
    runfile.check()
    layout = Layout(runfile)
    assert set(override) == set(runfile.launcher.services) and set(override) <= set(base)
    for name, svc in override.items():
        placed = layout.for_instance(name, 0, {}, set(range(64))).env
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert svc["cpuset"] == placed["RLBUS_PLACEMENT_CPUS"], name
        assert env["OMP_NUM_THREADS"] == placed["OMP_NUM_THREADS"], name
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if layout.cpu_only(name):
            assert not devices and env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
        else:
            (device,) = devices
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
            assert ",".join(device["device_ids"]) == placed["CUDA_VISIBLE_DEVICES"], name


def test_the_gpu_overlay_requests_its_placement_and_keeps_cpu_services_off_the_gpus():
    overlay_run, base_run = K8S / "overlays" / "gpu" / "run.toml", K8S / "base" / "run.toml"
    overlay, base = tomllib.loads(overlay_run.read_text()), tomllib.loads(base_run.read_text())
    assert overlay.pop("placement") and overlay == base  # the base run, placed
    runfile = RunFile.load(overlay_run, env={})
    runfile.check()
    layout = Layout(runfile)
    docs = render("overlays/gpu")
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rlbus-run")
    assert tomllib.loads(config["data"]["run.toml"])["placement"] == tomllib.loads(overlay_run.read_text())["placement"]
    for kind, name in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
        gpus, cpus = layout.requests(name)
        resources = container(docs, kind, name)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == gpus, name
        assert int(resources["requests"]["cpu"]) == cpus, name
    for kind, name in (("Deployment", "judge"), ("Deployment", "sandbox"), ("Deployment", "weightsync"),
                       ("DaemonSet", "weightsync-relay")):
        c = container(docs, kind, name)
        assert layout.cpu_only(name.split("-")[0]), name
        assert "nvidia.com/gpu" not in str(c.get("resources", {})), name
        env = env_of(c)
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void", name


def test_the_two_node_trainer_job_is_one_group_of_indexed_pods(tmp_path):
    docs = render("multinode")
    path = tmp_path / "multinode.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    validator = tool(str(DEPLOY_VENV / "bin" / "kubernetes-validate"), "run ./rlbus setup deploy (creates .venv-deploy)")
    result = subprocess.run([validator, "-k", K8S_SCHEMA_VERSION, "--strict", str(path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

    job = next(d for d in docs if d["kind"] == "Job")
    service = next(d for d in docs if d["kind"] == "Service")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    value = {k: e.get("value") for k, e in env.items()}
    nnodes, world = int(value["RLBUS__SERVICES__TRAINER__DEVICES__NNODES"]), int(
        value["RLBUS__SERVICES__TRAINER__DEVICES__WORLD_SIZE"])
    # one pod per node, all admitted together (Kueue), each node's index its node_rank
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nnodes == 2
    assert spec["suspend"] is True and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "trainers"
    index = env["RLBUS__SERVICES__TRAINER__DEVICES__NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # one GPU per rank: nproc_per_node GPUs per pod
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == world // nnodes
    # node 0 is reachable by name: pod 0's hostname in the headless Service's subdomain, both ports open
    port = int(value["RLBUS__SERVICES__TRAINER__DEVICES__MASTER_PORT"])
    assert value["RLBUS__SERVICES__TRAINER__DEVICES__MASTER_ADDR"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert service["metadata"]["name"] == pod["subdomain"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert {p["port"] for p in service["spec"]["ports"]} == {port, port + 1}
    # the checkpoints every node writes live on a volume the nodes share
    claim = next(v for v in pod["volumes"] if v["name"] == "checkpoints")["persistentVolumeClaim"]["claimName"]
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # the command and keys are the CLI's and the run file's; node 1's settings form a valid group
    args = check_command(c["args"], service="trainer")
    assert args.name == "trainer"
    from_pod = {"RLBUS__SERVICES__TRAINER__DEVICES__NODE_RANK": "1", "RLBUS__NATS__PASSWORD": "secret"}  # node 1's
    rlbus_env = {k: v if v is not None else from_pod[k] for k, v in value.items() if k.startswith("RLBUS__")}
    run_file = K8S / "base" / "run.toml"
    check_env("trainer", run_file, rlbus_env)
    overrides = [f"{k.removeprefix('RLBUS__').lower().replace('__', '.')}={v}" for k, v in rlbus_env.items()
                 if k.startswith("RLBUS__SERVICES__")]
    devices = RunFile.load(run_file, env={}, overrides=overrides).services.trainer.devices
    devices.check()
    assert (devices.nnodes, devices.node_rank, devices.nproc_per_node) == (2, 1, 4)


def test_the_two_node_skypilot_trainer_asks_one_gpu_per_rank_on_each_node():
    docs = list(yaml.safe_load_all((DEPLOY / "skypilot" / "rlbus-job-group-2node.yaml").read_text()))
    tasks = {d["name"]: d for d in docs[1:]}
    assert set(tasks) == {"trainer", "engines", "sandboxes"} and docs[0]["primary_tasks"] == ["trainer"]
    trainer = tasks["trainer"]
    nodes, per_node = trainer["num_nodes"], set(trainer["resources"]["accelerators"].values())
    assert nodes == 2 and per_node == {4}
    # what SkyPilot gives node 1 of the task, substituted into its command
    sky = {"SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NUM_GPUS_PER_NODE": "4", "SKYPILOT_NODE_RANK": "1",
           "RLBUS_EXAMPLE": trainer["envs"]["RLBUS_EXAMPLE"], "RLBUS_TRAINER_PORT": trainer["envs"]["RLBUS_TRAINER_PORT"]}

    def substitute(arg: str) -> str:
        arg = re.sub(r"\$\(\((\w+) \* (\w+)\)\)", lambda m: str(int(sky[m.group(1)]) * int(sky[m.group(2)])), arg)
        arg = re.sub(r"\$\(echo \$SKYPILOT_NODE_IPS \| head -n1\)", "10.0.0.1", arg)
        return re.sub(r"\$(\w+)", lambda m: sky.get(m.group(1), "x"), arg)

    (argv,) = [a for a in rlbus_lines(trainer["run"]) if a[:2] == ["service", "trainer"]]
    argv = [substitute(a) for a in argv]
    args = check_command(argv, service="trainer")
    runfile = RunFile.load(ROOT / args.config, env={}, overrides=args.overrides)
    devices = runfile.services.trainer.devices
    devices.check()
    assert (devices.world_size, devices.nnodes, devices.node_rank) == (8, 2, 1)
    assert devices.nproc_per_node == 4 and devices.master_addr == "10.0.0.1" and devices.master_port == 29500
    assert 'if [ "$SKYPILOT_NODE_RANK" = 0 ]' in trainer["run"]  # NATS, provision, weightsync on node 0 only
    for task in tasks.values():
        for a in rlbus_lines(task["run"]):
            check_command([substitute(x) for x in a])
