"""The integration recipe end to end: a service process started like the supervisor starts it, with its
generated login as ``--set`` overrides, works against the server run with the generated config; the
admin login serves ``rlbus status``.

Private inboxes need ``NatsSection.inbox_prefix`` in the runtime; until it exists this test runs the
recipe with shared inboxes (``private_inboxes=False``), which is what ``rlbus up`` can use today.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.echo import EchoReply, EchoRequest
from services.launcher.auth import generate_auth
from services.runtime import bus
from services.runtime.config import NatsSection
from services.runtime.natsd import EmbeddedNats

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
RUN = "sec1"
PRIVATE = "inbox_prefix" in NatsSection.__struct_fields__


def cli(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "services.launcher.cli", *args], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


async def test_echo_service_process_with_generated_login(tmp_path):
    bundle = generate_auth(tmp_path / "run", ["echo"], run_id=RUN, private_inboxes=PRIVATE)
    server = EmbeddedNats(tmp_path / "nats", port=None, config_file=bundle.server_config)
    server.start()
    proc = None
    try:
        nc = await nats.connect(server.url, allow_reconnect=False, **bundle.for_role("launcher").connect_kwargs())
        js = nc.jetstream(timeout=10.0)
        await bus.provision_all(js)
        echo = bundle.for_role("echo")
        overrides = [x for o in echo.nats_overrides() for x in ("--set", o)]
        proc = cli("service", "echo", "--nats-url", server.url, "--run-id", RUN, "--instance", "echo-0",
                   "--set", "common.heartbeat_s=0.2", *overrides, log=tmp_path / "echo.log")
        replies = await js.subscribe(f"rlbus.{RUN}.echo.out", ordered_consumer=True)
        await bus.publish(js, f"rlbus.{RUN}.echo.in", EchoRequest(run_id=RUN, text="hi"))
        await js.publish(f"rlbus.{RUN}.echo.in", b"\xc1 broken")
        reply = codec.decode((await replies.next_msg(timeout=60)).data, EchoReply)
        assert reply.text == "hi" and reply.worker == "echo-0"
        letters = await js.subscribe(f"rlbus.{RUN}.dlq.>", ordered_consumer=True)
        letter = codec.decode((await letters.next_msg(timeout=30)).data, DeadLetter)
        assert letter.service == "echo" and letter.error_type == "DecodeError"
        assert f"{RUN}.echo.echo-0" in await (await js.key_value(catalog.MEMBERS.bucket)).keys()

        admin = [x for o in bundle.for_role("admin").nats_overrides() for x in ("--set", o)]
        status = subprocess.run(
            [sys.executable, "-m", "services.launcher.cli", "status", "--nats-url", server.url, "--run-id", RUN,
             *admin], cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert status.returncode == 0, status.stderr
        assert "echo-0" in status.stdout

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        await nc.close()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
    violations = [line for line in server.log_path.read_text().splitlines() if "Violation" in line]
    assert violations == [], violations
