"""Each role does its real job under its generated permissions, and the server refuses none of it.

Every test runs the real code of the services (the harness's ServiceContext, consume loop and
heartbeats, the weight publisher/subscriber/relay, the sandbox service and client, ``rlbus
status``/``tap``) on connections logged in as the generated users with private inboxes, then
checks both each client's error callback and the server log for permission violations.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import msgspec
import pytest

from proto import catalog, codec
from proto import sandbox as sapi
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.deadletter import DeadLetter
from proto.membership import Heartbeat
from proto.prompts import PromptTicket
from proto.rollouts import Rollout, RolloutGroup, Turn
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.runtime import bus, gang, service
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection
from services.runtime.gang import GangSection
from services.runtime.natsd import EmbeddedNats
from services.runtime.service import ServiceContext
from tests.security.conftest import RELAY, RUN, Login

pytestmark = pytest.mark.timeout(120)


def server_violations(server: EmbeddedNats) -> list[str]:
    """Permission violations the server logged (any user)."""
    return [line for line in server.log_path.read_text().splitlines() if "Violation" in line]


class Harness:
    """What ``services.runtime.service.serve`` does around a service, on a given connection."""

    def __init__(self, c: Login, role: str, instance: str, service_cfg: object = None) -> None:
        loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(),
                        common=CommonSection(heartbeat_s=0.2, drain_timeout_s=5.0), service=service_cfg)
        self.ctx = ServiceContext(role, instance, loaded, c.nc)
        self._hb: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ServiceContext:
        await bus.provision_all(self.ctx.js)
        self._hb = asyncio.create_task(service._heartbeats(self.ctx, 0.2), name=f"{self.ctx.name}-hb")
        self.ctx.state = "running"
        return self.ctx

    async def __aexit__(self, *exc: object) -> None:
        self.ctx.stop.set()
        if self._hb is not None:
            self._hb.cancel()
            await asyncio.gather(self._hb, return_exceptions=True)
        kv = await self.ctx.js.key_value(catalog.MEMBERS.bucket)
        await kv.delete(f"{RUN}.{self.ctx.name}.{self.ctx.instance}")


async def read_stream(c: Login, subject: str, n: int, typ: type, timeout: float = 10.0) -> list:
    sub = await c.js.subscribe(subject, ordered_consumer=True)
    try:
        return [codec.decode((await sub.next_msg(timeout=timeout)).data, typ) for _ in range(n)]
    finally:
        await sub.unsubscribe()


async def test_the_work_loop_runs_under_its_permissions(login, server):
    """trainer → prompts → rollout → rollouts → judge → trajectories → trainer, plus heartbeats,
    metrics, run state, outcomes and a dead letter, each service as its own user."""
    trained = asyncio.Event()
    beats: list = []
    async with login("trainer") as tc, login("rollout") as rc, login("judge") as jc, login("admin") as ac:

        async def on_beat(m) -> None:
            beats.append(m)

        await ac.nc.subscribe(f"rlbus.{RUN}.heartbeat.>", cb=on_beat)
        async with Harness(tc, "trainer", "t0") as tctx, Harness(rc, "rollout", "r0") as rctx, \
                Harness(jc, "judge", "j0") as jctx:

            async def on_prompt(t: PromptTicket, d) -> None:
                await rctx.publish(catalog.ROLLOUTS, RolloutGroup.of([Rollout(
                    run_id=RUN, task=t.task, group_id=t.group_id, prompt_id=t.prompt_id, sample_index=0,
                    group_size=1, prompt_ids=t.prompt_ids, turns=[Turn(role="assistant", token_ids=[5])],
                    finish_reason="stop", policy_version=t.policy_version)]))
                await rctx.report({"rollout/tickets": 1.0})

            async def on_rollout(g: RolloutGroup, d) -> None:
                await jctx.publish(catalog.TRAJECTORIES, ScoredGroup.of(
                    [ScoredTrajectory(run_id=RUN, rollout=r, reward=1.0) for r in g.records()]))

            async def on_trajectory(g: ScoredGroup, d) -> None:
                await tctx.publish(catalog.OUTCOMES, OutcomeBatch(run_id=RUN, outcomes=[TrajectoryOutcome(
                    run_id=RUN, trajectory_id=t.msg_id, group_id=t.rollout.group_id, outcome="trained", step=1,
                    version=0, sample_version=0) for t in g.records()]))
                trained.set()

            consumers = [
                asyncio.create_task(rctx.consume(catalog.PROMPTS, on_prompt)),
                asyncio.create_task(jctx.consume(catalog.ROLLOUTS, on_rollout)),
                asyncio.create_task(tctx.consume(catalog.TRAJECTORIES, on_trajectory)),
            ]
            section = GangSection(roles={"trainer": 1, "rollout": 1, "judge": 1}, timeout_s=30.0)
            states = await asyncio.gather(*(gang.barrier(c.js, RUN, c.name, section, poll_s=0.1)
                                            for c in (tctx, rctx, jctx)))
            assert {s.state for s in states} == {"admitted"}  # gang start works under the permissions too
            runs = await bus.ensure_kv(tctx.js, catalog.RUNS)
            await runs.put(f"{RUN}.state", b"running")
            await tctx.js.publish(catalog.PROMPTS.subject(RUN), b"\xc1 not msgpack")  # poison: the rollout dead-letters it
            await tctx.publish(catalog.PROMPTS, PromptTicket(
                run_id=RUN, task="t", group_id="g", prompt_id="p", prompt_ids=[1, 2], group_size=1, policy_version=0))
            await tctx.report({"trainer/step": 1.0}, step=1)
            await asyncio.wait_for(trained.wait(), 30)

            members = await (await ac.js.key_value(catalog.MEMBERS.bucket)).keys()
            assert {f"{RUN}.trainer.t0", f"{RUN}.rollout.r0", f"{RUN}.judge.j0"} <= set(members)
            for ctx in (tctx, rctx, jctx):
                ctx.stop.set()
            await asyncio.gather(*consumers)

        [letter] = await read_stream(ac, f"rlbus.{RUN}.dlq.>", 1, DeadLetter)
        assert letter.service == "rollout" and letter.error_type == "DecodeError"
        [batch] = await read_stream(ac, f"rlbus.{RUN}.outcomes", 1, OutcomeBatch)
        assert [o.outcome for o in batch.records()] == ["trained"]
        assert {"trainer", "rollout", "judge"} <= {codec.decode(m.data, Heartbeat).service for m in beats}
        for c in (tc, rc, jc, ac):
            c.assert_clean()
    assert server_violations(server) == []


async def test_weights_flow_under_permissions(login, server, caplog):
    """The trainer publishes versions, weightsync relays them to its scope and runs retention,
    rollouts read from both scopes and claim a broadcast rank."""
    torch = pytest.importorskip("torch")
    from services.lib.weights.client import WeightPublisher, WeightSubscriber
    from services.lib.weights.objstore import ObjectStoreBlobs
    from services.runtime.weights_config import EncodingConfig, ObjStoreConfig
    from services.weightsync.config import RelayConfig, WeightsyncConfig
    from services.weightsync.service import WeightsyncService

    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}]
    for _ in range(3):
        states.append({k: v + (torch.rand(v.shape, generator=g) < 0.05) * 0.01 for k, v in states[-1].items()})

    async with login("trainer") as tc, login("weightsync") as wc, login("rollout") as rc:
        relay = WeightsyncService(wc.nc, WeightsyncConfig(
            run_id=RUN, relay=RelayConfig(scope=RELAY, store=ObjStoreConfig(), keep_anchors=1), keep_anchors=1))
        stop = asyncio.Event()
        relay_task = asyncio.create_task(relay.run(stop), name="weightsync")
        pub = WeightPublisher(tc.nc, RUN, ObjectStoreBlobs(tc.nc),
                              encoding=EncodingConfig(anchor_every=2, chunk_bytes=64 * 1024))
        main_sub = WeightSubscriber(rc.nc, RUN, ObjectStoreBlobs(rc.nc))
        relay_sub = WeightSubscriber(rc.nc, RUN, ObjectStoreBlobs(rc.nc, scope=RELAY), scope=RELAY)
        for v, state in enumerate(states, start=1):
            await pub.publish(state, version=v)
            await asyncio.wait_for(relay.wait_handled(v), 30)
        for sub in (main_sub, relay_sub):
            m = await sub.latest()
            assert m is not None and m.version == len(states)
            got = await sub.fetch(m)
            assert all(torch.equal(got[k], states[-1][k]) for k in states[-1])
        assert relay.stats.versions_relayed == len(states)
        assert 1 not in await pub.index.versions()  # retention deleted the oldest anchor upstream
        kv = await rc.js.key_value(f"rlbus_weights_{RELAY}")
        await kv.create(f"{RUN}.bcast.g1.rank.1", b"1")  # the broadcast transport's rank claim
        stop.set()
        await relay_task
        for c in (tc, wc, rc):
            c.assert_clean()
    assert server_violations(server) == []
    assert "fast chunk reader unavailable" not in caplog.text


async def test_sandbox_service_and_clients_under_permissions(login, server, tmp_path: Path):
    """The real sandbox service (unsafe-process backend) as user ``sandbox``; rollout and judge call it;
    its events land in SANDBOX_EVENTS; ``rlbus status``-style list works for the admin."""
    from services.lib.sandbox_client import SandboxClient
    from services.sandbox.config import SandboxConfig
    from services.sandbox.service import SandboxService

    cfg = SandboxConfig(type="unsafe-process", root_dir=str(tmp_path / "sbx"))
    async with login("sandbox") as sc, login("rollout") as rc, login("judge") as jc, login("admin") as ac:
        async with Harness(sc, "sandbox", "s0", cfg) as sctx:
            svc = SandboxService.from_loaded(sctx.cfg)
            task = asyncio.create_task(svc.run(sctx), name="sandbox-service")
            rollout_client = SandboxClient(rc.nc, RUN, timeout_s=20.0)
            await rollout_client.wait_ready(1)
            box = await rollout_client.create()
            out = await rollout_client.exec(box.sandbox_id, "echo hello")
            assert out.exit_code == 0 and out.stdout.strip() == b"hello"
            judge_client = SandboxClient(jc.nc, RUN, timeout_s=20.0)
            assert [s.sandbox_id for s in await judge_client.sandboxes(expected=1)] == [box.sandbox_id]
            await judge_client.destroy(box.sandbox_id)
            assert len(await SandboxClient(ac.nc, RUN, timeout_s=20.0).list(expected=1)) == 1
            sctx.stop.set()
            await asyncio.wait_for(task, 30)
        events = await read_stream(ac, catalog.SANDBOX_EVENTS.subject(RUN, box.sandbox_id), 2, sapi.SandboxEvent)
        assert events[0].kind == "created"
        for c in (sc, rc, jc, ac):
            c.assert_clean()
    assert server_violations(server) == []


async def test_admin_reads_status_and_taps(login, server):
    """``rlbus status`` and ``rlbus tap --from-start`` work for the read-only admin."""
    from services.launcher.status import collect
    from services.launcher.tap import tap

    async with login("trainer") as tc, login("admin") as ac:
        async with Harness(tc, "trainer", "t0") as tctx:
            await tctx.publish(catalog.PROMPTS, PromptTicket(
                run_id=RUN, task="t", group_id="g", prompt_id="p", prompt_ids=[1], group_size=1, policy_version=0))
            await (await bus.ensure_kv(tctx.js, catalog.MEMBERS)).put(
                f"{RUN}.trainer.t0", codec.encode(tctx.heartbeat()))
            st = await collect(ac.nc, RUN)
            assert any(m["service"] == "trainer" for m in st["members"])
            assert st["streams"]["PROMPTS"]["messages"] == 1
            runs = await bus.ensure_kv(tctx.js, catalog.RUNS)
            await runs.put(f"{RUN}.state", b"running")
            watcher = await (await bus.ensure_kv(ac.js, catalog.RUNS)).watch(f"{RUN}.state")  # rlbus run's progress
            assert (await watcher.updates(timeout=10)).value == b"running"
            await watcher.stop()
            out = io.StringIO()
            assert await tap(ac.nc, "prompts", RUN, from_start=True, count=1, out=out) == 1
            assert msgspec.json.decode(out.getvalue())["data"]["prompt_id"] == "p"
        for c in (tc, ac):
            c.assert_clean()
    assert server_violations(server) == []
