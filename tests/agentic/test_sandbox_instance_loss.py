"""A sandbox instance killed mid-episode costs no rollout: the agent loop starts the episode again on a new
sandbox, which the create puts on the surviving instance (``AgentSection.sandbox_retries``).

Real parts: two ``rlbus service sandbox`` processes (bubblewrap), nats-server, JetStream, the rollout and
judge services' handlers and consume loops in this process. The policy is the scripted stand-in
(:class:`agentic_harness.ScriptedEngine`). The instance that owns the episode's sandbox is SIGKILLed either
while the sandbox waits paused on inference (the next verb finds no responders) or while an exec runs in
it (the exec goes unanswered; the client's probe then finds no responders).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import uuid
from typing import Any

import nats
import pytest
from agentic_harness import RUN, ScriptedEngine, coding_prompt, loaded, ticket_for

from proto import catalog, codec
from proto import sandbox as api
from proto.trajectories import ScoredTrajectory
from services.judge.config import JudgeConfig
from services.judge.service import JudgeService
from services.launcher.accounting import accounting
from services.lib.sandbox_client import SandboxClient
from services.rollout.config import AgentSection, RolloutConfig, SandboxSection
from services.rollout.service import RolloutService
from services.runtime import bus as runtime_bus
from services.runtime.service import ServiceContext
from services.sandbox.overlay import mounts_under
from services.tasks import get_task
from services.tasks.grader_specs import RewardGraderSpec, SandboxTestsSpec

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHECK = "python3 -c 'from solution import add_2; print(add_2(40))'"
WRITE = "I will write the function.\n```python file=solution.py\ndef add_2(x):\n    return x + 2\n```\n"


class Instances:
    """``rlbus service sandbox`` processes of the run, each with a chosen instance id."""

    def __init__(self, url: str, root: str, tmp: str) -> None:
        self.url, self.root, self.tmp = url, root, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, instance_id: str) -> None:
        config = os.path.join(self.tmp, f"{instance_id}.toml")
        with open(config, "w") as f:
            f.write(f'[run]\nid = "{RUN}"\n[nats]\nurl = "{self.url}"\n[common]\ndrain_timeout_s = 5.0\n'
                    f'heartbeat_s = 0.5\n[services.sandbox]\nroot_dir = "{self.root}"\n'
                    f'instance_id = "{instance_id}"\n')
        with open(os.path.join(self.tmp, f"{instance_id}.log"), "ab") as log:
            self.procs[instance_id] = subprocess.Popen(
                [sys.executable, "-m", "services.launcher.cli", "service", "sandbox", "--config", config],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": REPO})

    def log(self, instance_id: str) -> str:
        with open(os.path.join(self.tmp, f"{instance_id}.log")) as f:
            return f.read()[-3000:]

    async def kill(self, instance_id: str) -> None:
        proc = self.procs[instance_id]
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)

    async def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.wait, 60)


async def serve(url: str, name: str, cfg: Any, tasks: list[tuple[ServiceContext, asyncio.Task[Any]]],
                build: Any) -> None:
    """A service's consume loop in this event loop, on its own connection; ``build(ctx)`` returns the
    channel and the handler."""
    ctx = ServiceContext(name, f"test-{name}", loaded(url, cfg), await nats.connect(url))
    channel, handle = build(ctx)
    tasks.append((ctx, asyncio.create_task(ctx.consume(channel, handle, concurrency=4), name=f"test-{name}")))


async def run_episode(nats_url: str, tmp_path: Any, tokenizer: Any, kill_during: str, retries: int
                      ) -> tuple[ScoredTrajectory, ScriptedEngine, RolloutService, dict[str, Any], list[str]]:
    """One agent rollout through two sandbox instances, killing its sandbox's owner once, at the second
    assistant turn (``kill_during="inference"``) or during the exec that turn asks for (``"exec"``).
    Returns the scored trajectory, the engine, the rollout service, the run's accounting and the killed
    instance (first) and the survivor."""
    root = f"/var/tmp/rlbus-agentic-{uuid.uuid4().hex[:8]}"  # reachable by the sandbox user
    os.makedirs(root, mode=0o711)
    inst = Instances(nats_url, root, str(tmp_path))
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    client = SandboxClient(nc, RUN, timeout_s=30.0)
    tasks: list[tuple[ServiceContext, asyncio.Task[Any]]] = []
    killed: list[str] = []
    try:
        await runtime_bus.provision_all(js)
        await runtime_bus.ensure_consumer(js, catalog.TRAINER_TRAJECTORIES.for_run(RUN))  # the trainer's, held
        inst.start("sbxa")
        inst.start("sbxb")
        try:
            await client.wait_ready(2, timeout_s=120)
        except Exception:
            pytest.fail(f"two sandbox instances did not come up:\n{inst.log('sbxa')}\n{inst.log('sbxb')}")

        async def kill_owner() -> None:
            [sb] = await client.sandboxes(expected=2)
            owner = api.instance_of(sb.sandbox_id)
            if kill_during == "exec":  # wait until the exec runs inside, then kill its instance under it
                sub = await js.subscribe(catalog.SANDBOX_EVENTS.subject(RUN, sb.sandbox_id), ordered_consumer=True)
                try:
                    while codec.decode((await sub.next_msg(timeout=60)).data, api.SandboxEvent).kind != \
                            "exec_started":
                        pass
                finally:
                    await sub.unsubscribe()
            await inst.kill(owner)
            killed.append(owner)

        killer: list[asyncio.Task[None]] = []

        async def hook(turn: int, context: str) -> None:
            if turn == 1 and not killer:
                killer.append(asyncio.create_task(kill_owner(), name="test-kill-owner"))
                if kill_during == "inference":
                    await killer[0]  # the sandbox is paused: the engine "generates" while its instance dies

        exec_s = 2.0 if kill_during == "exec" else 0.0
        script = [WRITE, f"Let me check it.\n```bash\nsleep {exec_s}; {CHECK}\n```\n", "It works: add_2 adds two."]
        engine = ScriptedEngine(tokenizer, script, hook=hook, version=3)
        agent = AgentSection(max_turns=4, wall_time_s=120.0, exec_timeout_s=8.0, sandbox_retries=retries,
                             sandbox=SandboxSection(disk_mb=64, inodes=4096))
        rollout_cfg = RolloutConfig(agent=agent)
        rollout = RolloutService(loaded(nats_url, rollout_cfg))

        def build_rollout(ctx: ServiceContext) -> Any:
            # exec replies are awaited for exec_timeout_s + 2 s; then the owner is probed
            rollout.attach(engine, tokenizer, SandboxClient(ctx.nc, RUN, timeout_s=20.0, exec_margin_s=2.0))
            return catalog.PROMPTS, lambda t, d: rollout.handle(ctx, t, d)

        judge_cfg = JudgeConfig(graders={"coding": [SandboxTestsSpec(weight=1.0), RewardGraderSpec(weight=0.0)]})
        judge = JudgeService(loaded(nats_url, judge_cfg))

        def build_judge(ctx: ServiceContext) -> Any:
            judge.attach(SandboxClient(ctx.nc, RUN, timeout_s=20.0))
            return catalog.ROLLOUTS, lambda r, d: judge.handle(ctx, r, d)

        await serve(nats_url, "rollout", rollout_cfg, tasks, build_rollout)
        await serve(nats_url, "judge", judge_cfg, tasks, build_judge)
        task = get_task("coding")
        await runtime_bus.publish(js, f"rlbus.{RUN}.prompts", ticket_for(task, tokenizer, coding_prompt(), "g-kill", 1))
        sub = await js.subscribe(f"rlbus.{RUN}.trajectories", stream=catalog.TRAJECTORIES_STREAM.name,
                                 ordered_consumer=True)
        try:
            [traj] = catalog.members(codec.decode((await sub.next_msg(timeout=180)).data, catalog.TRAJECTORIES.msg_type))
        finally:
            await sub.unsubscribe()
        await killer[0]
        survivor = next(i for i in inst.procs if i not in killed)
        acc = await accounting(js, RUN)
        return traj, engine, rollout, acc, [*killed, survivor]
    finally:
        for ctx, t in reversed(tasks):
            ctx.stop.set()
            await asyncio.wait_for(t, 60)
            await ctx.nc.close()
        await inst.stop_all()
        if killed:  # a successor with the killed instance's id reaps what it left (mounts, cgroups, processes)
            inst.start(killed[0])
            await client.wait_ready(1, timeout_s=120)
            await inst.stop_all()
        await nc.close()
        leftovers = mounts_under(root), os.listdir(root)
        shutil.rmtree(root, ignore_errors=True)
        assert leftovers == ([], []), f"sandbox state left behind: {leftovers}"


@pytest.mark.parametrize("kill_during", ["inference", "exec"])
async def test_a_killed_sandbox_instance_costs_no_rollout(nats_url, tmp_path, tokenizer, kill_during):
    traj, engine, rollout, acc, (killed, survivor) = await run_episode(nats_url, tmp_path, tokenizer, kill_during,
                                                                      retries=2)
    r = traj.rollout
    # the episode started again from its beginning on a sandbox of the surviving instance, and finished
    assert engine.calls == [0, 1, 0, 1, 2]
    assert r.finish_reason == "eos" and r.error is None, r.error
    assert api.instance_of(r.sandbox_id) == survivor != killed
    assert [t.role for t in r.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "exit code 0" in r.turns[3].text and "42" in r.turns[3].text
    # counted as retried, not as an error; graded like any other rollout
    assert r.metadata["sandbox_retries"] == "1"
    assert rollout.agents.counters["sandbox_retries"] == 1 and rollout.agents.counters["errors"] == 0
    assert traj.reward == 1.0
    # nothing lost: the one trajectory is published and held by the trainer's consumer
    assert acc["published"] == 1 and acc["lost"] == 0 and acc["held_by_trainer_consumer"] == 1, acc


async def test_past_its_retries_the_rollout_ends_with_the_reason(nats_url, tmp_path, tokenizer):
    traj, engine, rollout, acc, (killed, _) = await run_episode(nats_url, tmp_path, tokenizer, "inference",
                                                               retries=0)
    r = traj.rollout
    assert engine.calls == [0, 1]
    assert r.finish_reason == "error" and "sandbox" in r.error and killed in r.error and "gone" in r.error, r.error
    assert "sandbox_retries" not in r.metadata
    assert rollout.agents.counters["sandbox_retries"] == 0 and rollout.agents.counters["errors"] == 1
    assert traj.reward == 0.0
    assert acc["published"] == 1 and acc["lost"] == 0, acc
