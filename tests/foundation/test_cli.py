"""`rlbus up` starts NATS + services; `rlbus tap` shows heartbeats; Ctrl-C leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from services.launcher.auth import AUTH_DIR
from services.runtime.natsd import free_port
from tests.conftest import wait_for


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            pids.append(int(d.name))
    return pids


def test_up_tap_status_and_ctrl_c(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    cfg = tmp_path / "echo.toml"
    cfg.write_text(f'[run]\nid = "clitest"\ndir = "{run_dir}"\n[launcher]\nservices = {{ echo = 2 }}\n'
                   f"nats_port = {port}\n[common]\nheartbeat_s = 0.5\n")
    up = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "up", str(cfg)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"nats://127.0.0.1:{port}"
        # `rlbus up` writes the run's generated logins before it starts the server; tap reads them
        wait_for(lambda: (run_dir / AUTH_DIR / "credentials.json").is_file(), 60, "rlbus up's generated logins")
        status = wait_for(lambda: (st := _status(url, cfg)) and "ECHO" in st["streams"] and st, 30,
                          "two members and their stream in rlbus status")
        assert {m["instance"] for m in status["members"]} == {"echo-0", "echo-1"}
        # both services (both members now) heartbeat: tap decodes them to JSON lines
        tap = subprocess.run([sys.executable, "-m", "services.launcher.cli", "tap", "heartbeat", "--nats-url", url,
                              "--run-id", "clitest", "--count", "6", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert tap.returncode == 0, tap.stderr
        lines = [json.loads(line) for line in tap.stdout.splitlines()]
        assert len(lines) == 6
        assert all(rec["subject"].startswith("rlbus.clitest.heartbeat.echo") for rec in lines)
        assert {rec["data"]["instance"] for rec in lines} == {"echo-0", "echo-1"}
        assert all(rec["data"]["type"] == "heartbeat" and rec["data"]["state"] in ("starting", "running") for rec in lines)
        assert any(rec["data"]["state"] == "running" for rec in lines)

        # the nats CLI context rlbus up wrote: the admin login of this server (logging in with it works)
        context = json.loads((run_dir / "nats-context.json").read_text())
        assert context["url"] == url and context["user"] and oct((run_dir / "nats-context.json").stat().st_mode)[-3:] == "600"

        async def admin_login() -> list[str]:
            import nats

            nc = await nats.connect(context["url"], user=context["user"], password=context["password"])
            names = [si.config.name for si in await nc.jetstream().streams_info()]
            await nc.close()
            return names

        import asyncio

        assert "ECHO" in asyncio.run(admin_login())

        assert len(processes_mentioning(str(tmp_path))) >= 3  # nats-server + 2 services
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
        assert up.returncode == 0, out
        assert "stopped" in out
        assert processes_mentioning(str(tmp_path)) == []
        assert (run_dir / "logs" / "echo-0.log").read_text().count("SIGTERM received") == 1
    finally:
        if up.poll() is None:
            up.kill()


def _status(url: str, cfg):
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "status", "--nats-url", url, "--run-id",
                        "clitest", "--json", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return None
    st = json.loads(r.stdout)
    return st if len(st["members"]) == 2 else None


def test_help_explains_every_command():
    for cmd in ["up", "service", "tap", "status", "services"]:
        r = subprocess.run([sys.executable, "-m", "services.launcher.cli", cmd, "--help"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and len(r.stdout) > 200, (cmd, r.stdout)


def test_tap_replays_a_family_from_a_stream(nats_url):
    import asyncio

    import nats

    from proto.metrics import MetricsReport
    from services.runtime import bus

    async def publish():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.provision_all(js)
        for i in range(3):
            await bus.publish(js, f"rlbus.taprun.metrics.svc{i}", MetricsReport(run_id="taprun", service=f"svc{i}",
                                                                                instance="x", values={"a": i}))
        await nc.close()

    asyncio.run(publish())
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "tap", "metrics", "--nats-url", nats_url,
                        "--run-id", "taprun", "--from-start", "--count", "3"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [rec["data"]["service"] for rec in recs] == ["svc0", "svc1", "svc2"]
    assert all(rec["seq"] >= 1 for rec in recs)


def test_run_without_a_target_is_the_rl_example():
    """The README's first command (`./rlbus` = `rlbus run`) is the main job: an RL run, not a demo."""
    from services.launcher.cli import build_parser, resolve_target

    args = build_parser().parse_args(["run"])
    assert resolve_target(args.target).endswith("examples/addition.toml")
    assert build_parser().parse_args(["up"]).config is None  # up falls back to the same example
