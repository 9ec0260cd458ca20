"""A service with wrong credentials stops with a clear error instead of retrying forever."""

from __future__ import annotations

import subprocess
import sys

from services.launcher.auth import generate_auth
from services.runtime.natsd import EmbeddedNats


def test_wrong_password_exits_with_a_clear_error(tmp_path):
    bundle = generate_auth(tmp_path / "run", {"echo": 1}, run_id="badcred")
    with EmbeddedNats(tmp_path / "nats", port=None, config_file=bundle.server_config) as server:
        r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--nats-url", server.url,
                            "--run-id", "badcred", "--set", 'nats.user="echo"', "--set", 'nats.password="wrong"'],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "refused the credentials" in r.stderr and "Authorization Violation" in r.stderr
