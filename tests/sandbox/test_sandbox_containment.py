"""Hostile code is contained: each attack is its own test and must fail."""

from __future__ import annotations

import os

from sbx_helpers import RUN, exec_pids, host_address, needs_host_address, needs_python, new_sandbox, sh

from proto import sandbox as api

REPO_FILE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"))

NET_PROBE = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=2).close()
    print("CONNECTED")
except OSError as e:
    print("FAILED", type(e).__name__)
"""

CONNECT = """
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=5)
c.set_tunnel(sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1", int(sys.argv[1]))
try:
    c.request("GET", "/")
    print("TUNNEL", c.getresponse().read().decode())
except OSError as e:
    print("TUNNEL-FAILED", e)
"""

FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except Exception as e:
    print("FAILED", e)
"""


async def test_cannot_read_the_repository(backend):
    assert os.path.exists(REPO_FILE)
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, f"cat {REPO_FILE}; ls {os.path.dirname(REPO_FILE)}")
    assert r.exit_code != 0
    assert b"rlbus" not in r.stdout and r.stdout == b""


async def test_cannot_read_root_home(backend):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "ls -a /root; cat /root/.bashrc /etc/shadow")
    assert r.exit_code != 0 and r.stdout == b""


async def test_cannot_read_host_proc_entries(backend):
    sid = await new_sandbox(backend)
    me = os.getpid()
    r = await sh(backend, sid, f"cat /proc/{me}/environ /proc/{me}/cmdline; cat /proc/1/environ | tr '\\0' '\\n'")
    assert r.stdout.count(b"\n") <= 5  # only the sandbox's own init's tiny scrubbed environment, if anything
    assert b"pytest" not in r.stdout and b"RLBUS" not in r.stdout and b"VIRTUAL_ENV" not in r.stdout


async def test_cannot_write_the_base_root(backend):
    sid = await new_sandbox(backend)
    before = open("/etc/hostname", "rb").read()
    r = await sh(backend, sid, "touch /usr/pwned || echo refused1; echo x > /etc/hostname || echo refused2; "
                               "rm -f /bin/sh || echo refused3; mkdir /newdir || echo refused4")
    assert r.stdout.count(b"refused") == 4
    assert not os.path.exists("/usr/pwned") and os.path.exists("/bin/sh")
    assert open("/etc/hostname", "rb").read() == before


async def test_cannot_see_host_processes(backend):
    sid = await new_sandbox(backend)
    me = os.getpid()
    r = await sh(backend, sid, f"ls /proc | grep -c '^[0-9]'; kill -0 {me} && echo SIGNALLED; kill -0 1 && echo own-init")
    visible = int(r.stdout.split()[0])
    # bwrap's init (or the exec server, then also the exec's shepherd), the shell, ls and grep: nothing of the host's
    assert visible <= (5 if backend.sandboxes[sid].server is not None else 4)
    assert b"SIGNALLED" not in r.stdout


@needs_python
async def test_fork_bomb_stops_at_the_pids_limit(backend, events):
    sid = await new_sandbox(backend, limits=api.Limits(pids=32))
    script = (
        "import os, time\n"
        "made = 0\n"
        "for _ in range(500):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        made += 1\n"
        "    except BlockingIOError:\n"
        "        print('EAGAIN', made); break\n"
    )
    r = await backend.exec(_py(sid, script, timeout_s=20))
    assert b"EAGAIN" in r.stdout
    made = int(r.stdout.split()[1])
    assert made < 32
    # and the classic shell bomb is contained too (until its timeout)
    bomb = await sh(backend, sid, "b() { b | b & }; b; sleep 2; echo survived", timeout_s=5)
    assert exec_pids(backend, sid) == []  # only the exec server (if any) is left
    assert bomb.exit_code is not None


@needs_python
async def test_memory_bomb_is_oom_killed(backend, events):
    sid = await new_sandbox(backend, limits=api.Limits(memory_mb=64))
    r = await backend.exec(_py(sid, "a = []\nwhile True:\n    a.append(bytearray(8 << 20))\n", timeout_s=30))
    assert r.oom_killed and not r.timed_out
    assert r.exit_code == 137
    oom = events.of(sid, "oom")
    assert oom and oom[0].detail.memory_mb == 64


async def test_cpu_spin_is_stopped_by_the_timeout(backend, events):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "while :; do :; done", timeout_s=1)
    assert r.timed_out and r.exit_code == 137
    assert events.of(sid, "timeout")
    assert exec_pids(backend, sid) == []  # only the exec server (if any) is left


@needs_python
async def test_no_network_without_allowlist(backend, http_server_factory):
    port = http_server_factory(b"host-secret")
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, f"python3 -c '{NET_PROBE}' 127.0.0.1 {port}; python3 -c '{NET_PROBE}' 1.1.1.1 80; "
                               "cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    lines = r.stdout.decode().split()
    assert "CONNECTED" not in lines
    assert r.stdout.count(b"FAILED") == 2
    assert lines[-1] == "lo"  # the only interface


@needs_python
@needs_host_address
async def test_allowlist_lets_through_only_listed_hosts(backend, events, http_server_factory):
    # the hosts are on this host's non-loopback address: a public-looking target (loopback never is one)
    ip = host_address()
    ok_port = http_server_factory(b"allowed-body", host=ip)
    bad_port = http_server_factory(b"forbidden-body", host=ip)
    sid = await new_sandbox(backend, egress=[f"{ip}:{ok_port}"])
    r = await sh(backend, sid, f"python3 -c '{FETCH}' http://{ip}:{ok_port}/x; "
                               f"python3 -c '{FETCH}' http://{ip}:{bad_port}/x; "
                               f"python3 -c '{CONNECT}' {ok_port} {ip}; python3 -c '{CONNECT}' {bad_port} {ip}; "
                               f"python3 -c '{NET_PROBE}' {ip} {ok_port}")
    out = r.stdout.decode()
    assert "TUNNEL allowed-body" in out and "TUNNEL-FAILED Tunnel connection failed: 403" in out  # CONNECT
    assert "allowed-body" in out  # through the proxy
    assert "forbidden-body" not in out and "403" in out
    assert out.strip().split("\n")[-1].startswith("FAILED")  # no direct route even to an allowed host
    refused = events.of(sid, "egress_refused")
    assert [(e.detail.host, e.detail.port) for e in refused] == [(ip, bad_port)] * 2


def _py(sid: str, script: str, timeout_s: float) -> api.ExecRequest:
    return api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["python3", "-c", script]),
                           timeout_s=timeout_s)
