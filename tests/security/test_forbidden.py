"""The server refuses what a role must not do, and refuses logins with wrong credentials.

Each forbidden publish or subscription is attempted on a real nats-server started with the
generated config; the test waits for the server's own "Permissions Violation" for exactly that
subject, and checks that nothing forged reached a stream.
"""

from __future__ import annotations

import nats
import pytest

from proto import catalog
from services.launcher.auth import generate_auth
from services.lib.weights.index import VersionIndex
from tests.security.conftest import OTHER_RUN, RUN

pytestmark = pytest.mark.timeout(60)

W_KV = "$KV.rlbus_weights_main"
W_OBJ = "$O.rlbus_weight_blobs_main"
API = "$JS.API"

#: what anyone but the named producer must not publish
NOT_THEIRS = {
    "prompts": f"rlbus.{RUN}.prompts",  # trainer only
    "trajectories": f"rlbus.{RUN}.trajectories",  # judge only
    "rollouts": f"rlbus.{RUN}.rollouts",  # rollout only
    "announce": f"rlbus.{RUN}.weights.announce.main",  # trainer only
    "latest": f"{W_KV}.{RUN}.latest",  # trainer only
    "manifest": f"{W_KV}.{RUN}.v.0000000009",  # trainer (and weightsync retention)
    "chunk": f"{W_OBJ}.C.forgedchunk",  # trainer only
}

FORBIDDEN: dict[str, list[tuple[str, str]]] = {
    "rollout": [
        ("publish", NOT_THEIRS["trajectories"]), ("publish", NOT_THEIRS["prompts"]),
        ("publish", NOT_THEIRS["announce"]), ("publish", NOT_THEIRS["latest"]), ("publish", NOT_THEIRS["manifest"]),
        ("publish", NOT_THEIRS["chunk"]), ("publish", f"{W_KV}.{RUN}.bcast.ready"),
        ("publish", f"{API}.STREAM.PURGE.OBJ_rlbus_weight_blobs_main"),
        ("publish", f"{API}.STREAM.UPDATE.PROMPTS"), ("publish", f"{API}.STREAM.DELETE.TRAJECTORIES"),
        ("publish", f"{API}.CONSUMER.DURABLE.CREATE.TRAJECTORIES.trainer-{RUN}"),
        ("publish", f"{API}.CONSUMER.MSG.NEXT.TRAJECTORIES.trainer-{RUN}"),
        ("publish", f"rlbus.{RUN}.heartbeat.trainer"), ("publish", f"$KV.rlbus_members.{RUN}.trainer.t0"),
        ("publish", f"rlbus.{OTHER_RUN}.rollouts"), ("publish", f"{API}.CONSUMER.MSG.NEXT.PROMPTS.rollout-{OTHER_RUN}"),
        ("subscription", NOT_THEIRS["trajectories"]), ("subscription", "_INBOX.>"),
        ("subscription", "_INBOX_trainer.>"), ("subscription", ">"),
    ],
    "judge": [
        ("publish", NOT_THEIRS["prompts"]), ("publish", NOT_THEIRS["rollouts"]), ("publish", NOT_THEIRS["announce"]),
        ("publish", NOT_THEIRS["latest"]), ("publish", NOT_THEIRS["chunk"]),
        ("publish", f"$JS.ACK.TRAJECTORIES.trainer-{RUN}.1.1.1.1.0"),
        ("subscription", "_INBOX_trainer.>"), ("subscription", f"rlbus.{RUN}.sandbox.api.>"),
    ],
    "sandbox": [
        ("subscription", NOT_THEIRS["trajectories"]), ("subscription", f"rlbus.{RUN}.>"),
        ("subscription", "_INBOX_trainer.>"), ("subscription", "_INBOX.>"), ("subscription", "_INBOX_judge.>"),
        ("publish", f"{API}.CONSUMER.CREATE.TRAJECTORIES"),
        ("publish", f"{API}.CONSUMER.DURABLE.CREATE.TRAJECTORIES.snoop"),
        ("publish", f"{API}.STREAM.MSG.GET.TRAJECTORIES"), ("publish", f"{API}.DIRECT.GET.TRAJECTORIES"),
        ("publish", NOT_THEIRS["trajectories"]), ("publish", NOT_THEIRS["rollouts"]), ("publish", NOT_THEIRS["latest"]),
        ("publish", f"rlbus.{RUN}.sandbox.api.create"),
    ],
    "trainer": [
        ("publish", NOT_THEIRS["trajectories"]), ("publish", NOT_THEIRS["rollouts"]),
        ("publish", f"rlbus.{RUN}.sandbox.api.create"), ("publish", f"{API}.STREAM.DELETE.PROMPTS"),
        ("publish", f"{API}.CONSUMER.MSG.NEXT.PROMPTS.rollout-{RUN}"), ("publish", f"rlbus.{OTHER_RUN}.prompts"),
    ],
    "weightsync": [
        ("publish", NOT_THEIRS["latest"]), ("publish", NOT_THEIRS["announce"]), ("publish", NOT_THEIRS["chunk"]),
        ("publish", NOT_THEIRS["trajectories"]), ("publish", NOT_THEIRS["prompts"]),
        ("publish", f"{W_KV}.{OTHER_RUN}.v.0000000001"),
    ],
    "echo": [
        ("publish", f"rlbus.{RUN}.echo.in"), ("publish", NOT_THEIRS["prompts"]),
        ("subscription", f"rlbus.{RUN}.echo.>"),
    ],
    "admin": [
        ("publish", NOT_THEIRS["prompts"]), ("publish", NOT_THEIRS["latest"]),
        ("publish", f"$KV.rlbus_members.{RUN}.trainer.t0"), ("publish", f"{API}.STREAM.DELETE.PROMPTS"),
        ("publish", f"{API}.STREAM.PURGE.TRAJECTORIES"), ("publish", f"{API}.CONSUMER.DELETE.TRAJECTORIES.trainer-{RUN}"),
        ("publish", f"{API}.CONSUMER.MSG.NEXT.TRAJECTORIES.trainer-{RUN}"),
        ("publish", f"$JS.ACK.TRAJECTORIES.trainer-{RUN}.1.1.1.1.0"),
        ("subscription", "_INBOX_trainer.>"),
    ],
}


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
async def test_forbidden_operations_are_refused_by_the_server(login, role):
    async with login(role) as c, login("launcher") as lc:
        for kind, subject in FORBIDDEN[role]:
            if kind == "publish":
                await c.nc.publish(subject, b"forged", reply=c.nc.new_inbox())
            else:
                await c.nc.subscribe(subject)
            await c.nc.flush()
            await c.violation(kind, subject)
        assert c.nc.is_connected  # refused, not disconnected: the rest of its work goes on
        assert len(c.violations) == len(FORBIDDEN[role])
        for name in ("PROMPTS", "ROLLOUTS", "TRAJECTORIES"):
            assert (await lc.js.stream_info(name)).state.messages == 0, f"a forged message reached {name}"


async def test_real_client_calls_fail_for_the_wrong_role(login):
    """The same refusals through the client APIs a compromised service would use."""
    async with login("sandbox") as sc, login("rollout") as rc:
        with pytest.raises(nats.errors.Error):
            await sc.js.pull_subscribe(f"rlbus.{RUN}.trajectories", durable="snoop", stream="TRAJECTORIES")
        await sc.violation("publish", "$JS.API.CONSUMER.INFO.TRAJECTORIES.snoop")
        with pytest.raises(nats.errors.TimeoutError):
            await rc.js.publish(f"rlbus.{RUN}.trajectories", b"forged", timeout=1.0)
        await rc.violation("publish", f"rlbus.{RUN}.trajectories")
        kv = await VersionIndex(rc.nc, RUN).kv()  # a rollout may open (and create) the bucket, not announce
        with pytest.raises(nats.errors.TimeoutError):
            await kv.put(f"{RUN}.latest", b"forged")
        await rc.violation("publish", f"$KV.rlbus_weights_main.{RUN}.latest")


async def test_consumers_are_pinned_to_their_run(login):
    """A rollout of run r1 cannot create or pull the prompt consumer of run r2."""
    async with login("rollout") as rc:
        cdef = catalog.ROLLOUT_PROMPTS.for_run(OTHER_RUN)
        with pytest.raises(nats.errors.Error):
            await rc.js.add_consumer(cdef.stream, durable_name=cdef.durable, filter_subject=cdef.filter_subject)
        await rc.violation("publish", f"$JS.API.CONSUMER.DURABLE.CREATE.PROMPTS.rollout-{OTHER_RUN}")


async def test_wrong_credentials_cannot_connect(server, bundle, tmp_path):
    other = generate_auth(tmp_path / "other-run", ["trainer"], run_id=RUN)
    trainer = bundle.for_role("trainer")
    attempts = {
        "wrong password": {"user": trainer.user, "password": "0" * 48},
        "another role's password": {"user": trainer.user, "password": bundle.for_role("rollout").password},
        "another bundle's password": {"user": trainer.user, "password": other.for_role("trainer").password},
        "unknown user": {"user": "mallory", "password": trainer.password},
        "no credentials": {},
    }
    for what, kwargs in attempts.items():
        with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5,
                               **kwargs)
        assert what  # the label documents the case in a failure's traceback
    nc = await nats.connect(server.url, allow_reconnect=False, **trainer.connect_kwargs())
    assert nc.is_connected
    await nc.close()
