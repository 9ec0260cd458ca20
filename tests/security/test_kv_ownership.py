"""Each role writes only its own keys of the run bucket: the judge's credentials cannot overwrite the gang
record of a run, nor the trainer's state, and ``rlbus status`` keeps reporting the admitted run as admitted.

Real nats-server with the generated per-service users; the gang is admitted by the real barrier of three
members (trainer, rollout, judge), each on its own login with heartbeats, as the harness runs them.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest

from proto import catalog, codec
from services.launcher.status import collect, format_status
from services.runtime import bus, gang
from services.runtime.gang import GangSection, GangState
from tests.security.conftest import RUN
from tests.security.test_roles_work import Harness, server_violations

pytestmark = pytest.mark.timeout(120)

RUNS = f"$KV.{catalog.RUNS.bucket}.{RUN}"
FAILED = codec.encode(GangState(state="failed", missing={"judge": 1}))


async def refused_put(c, key: str, value: bytes) -> None:
    """A KV put of ``key`` with ``c``'s credentials (the JetStream publish ``KeyValue.put`` makes, with a short
    timeout): the server refuses it (no ack, a permissions violation)."""
    subject = f"$KV.{catalog.RUNS.bucket}.{key}"
    with pytest.raises(nats.errors.TimeoutError):
        await c.js.publish(subject, value, timeout=1.0)
    await c.violation("publish", subject)


async def test_no_role_overwrites_another_roles_run_keys(login, server):
    async with login("trainer") as tc, login("rollout") as rc, login("judge") as jc, login("admin") as ac:
        async with Harness(tc, "trainer", "t0") as tctx, Harness(rc, "rollout", "r0") as rctx, \
                Harness(jc, "judge", "j0") as jctx:
            section = GangSection(roles={"trainer": 1, "rollout": 1, "judge": 1}, timeout_s=30.0)
            states = await asyncio.gather(*(gang.barrier(c.js, RUN, c.name, section, poll_s=0.1)
                                            for c in (tctx, rctx, jctx)))
            assert {s.state for s in states} == {"admitted"}
            decided = await gang.decision(ac.js, RUN)
            assert decided is not None and decided.state.state == "admitted"
            # every member put the decision on record under its own role's key (proposed or endorsed)
            assert sorted(decided.proposers) == ["judge", "rollout", "trainer"]
            runs = await bus.ensure_kv(tctx.js, catalog.RUNS)
            await runs.put(f"{RUN}.state", codec.msgspec.msgpack.encode({"state": "running", "step": 3,
                                                                         "version": 3}))

            # the attack of the report: the judge overwrites the gang record, under every name it might use
            for key in (f"{RUN}.gang", f"{RUN}.gang.trainer", f"{RUN}.gang.rollout", f"{RUN}.state"):
                await refused_put(jc, key, FAILED)
            await refused_put(rc, f"{RUN}.gang.judge", FAILED)  # nor may the rollout write the judge's key
            await refused_put(rc, f"{RUN}.state", FAILED)
            # its own key it may write: after the decision, that write decides nothing
            await (await jc.js.key_value(catalog.RUNS.bucket)).put(f"{RUN}.gang.judge", FAILED)
            assert len(jc.violations) == 4 and len(rc.violations) == 2

            decided = await gang.decision(ac.js, RUN)
            assert decided.state.state == "admitted" and decided.ignored == {"judge": "failed"}
            st = await collect(ac.nc, RUN)
            assert st["gang"]["state"] == "admitted" and st["gang"]["ignored_later"] == {"judge": "failed"}
            assert st["trainer"] == {"state": "running", "step": 3, "version": 3}
            assert "gang: " in format_status(st) and "'admitted'" in format_status(st)
            # a member that starts later (a restarted judge) follows the decision, not the judge's late write
            assert (await gang.barrier(jctx.js, RUN, "judge", section, poll_s=0.1)).state == "admitted"

            # the trainer's own writes and the launcher's reset still work
            await runs.put(f"{RUN}.state", b"\x80")
            async with login("launcher") as lc:
                await gang.reset(lc.js, RUN)
                assert await gang.decision(ac.js, RUN) is None
                lc.assert_clean()
        for c in (tc, ac):
            c.assert_clean()
    logged = server_violations(server)
    assert len(logged) == 6 and all(("judge" in line) or ("rollout" in line) for line in logged), logged


async def test_first_proposal_decides_even_when_its_role_rewrites_it(login, server):
    """The judge admitted the run alone (its proposal is first); the others endorsed it. When the judge's
    credentials later rewrite the judge's own key as failed, the endorsements come first: still admitted."""
    async with login("trainer") as tc, login("judge") as jc, login("admin") as ac:
        async with Harness(tc, "trainer", "t0") as tctx, Harness(jc, "judge", "j0") as jctx:
            section = GangSection(roles={"trainer": 1, "judge": 1}, timeout_s=30.0)
            assert (await gang.barrier(jctx.js, RUN, "judge", section, poll_s=0.1)).state == "admitted"
            assert (await gang.decision(ac.js, RUN)).proposers == ["judge"]
            assert (await gang.barrier(tctx.js, RUN, "trainer", section, poll_s=0.1)).state == "admitted"
            kv = await jc.js.key_value(catalog.RUNS.bucket)
            await kv.put(f"{RUN}.gang.judge", FAILED)
            await kv.purge(f"{RUN}.gang.judge")
            await kv.put(f"{RUN}.gang.judge", FAILED)
            decided = await gang.decision(ac.js, RUN)
            assert decided.state.state == "admitted" and decided.by == "trainer"
            assert msgspec.structs.asdict(decided)["ignored"] == {"judge": "failed"}
        for c in (tc, jc, ac):
            c.assert_clean()
    assert server_violations(server) == []
