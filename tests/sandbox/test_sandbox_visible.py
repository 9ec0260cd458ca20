"""What a sandbox can read outside its work directory, compared with an allowlist; and its /etc is
synthesized, not the host's (real bwrap backend, as root)."""

from __future__ import annotations

import json
import os

from sbx_helpers import RUN, make_config, needs_python, new_sandbox, sh

from proto import sandbox as api
from services.sandbox.bwrap import BwrapBackend
from services.sandbox.config import DEFAULT_HOST_PATHS

#: the synthesized /etc, file by file (``alternatives`` is the host's, bound read-only: links to programs)
ETC_ALLOWED = {"passwd", "group", "hosts", "hostname", "nsswitch.conf", "resolv.conf", "protocols", "services",
               "ld.so.cache", "os-release", "alternatives", "ssl", "ssl/certs", "ssl/certs/ca-certificates.crt",
               "ssl/cert.pem"}
#: bwrap's minimal /dev
DEV_ALLOWED = {"null", "zero", "full", "random", "urandom", "tty", "shm", "pts", "ptmx", "fd", "stdin", "stdout",
               "stderr", "core", "console", "mqueue", "hugepages"}
#: the system trees (read-only), the work directory, /tmp, /dev, /proc and the synthesized /etc
SYSTEM_TREES = {p.strip("/") for p in DEFAULT_HOST_PATHS}

INVENTORY = r"""
import json, os
def walk(top, skip=()):
    out = set()
    for d, dirs, files in os.walk(top):
        dirs[:] = [x for x in dirs if os.path.join(d, x) not in skip]
        for name in dirs + files:
            out.add(os.path.relpath(os.path.join(d, name), top))
    return sorted(out)
alternatives = {n: os.readlink('/etc/alternatives/' + n) for n in os.listdir('/etc/alternatives')
                if os.path.islink('/etc/alternatives/' + n)}
print(json.dumps({
    "top": sorted(os.listdir('/')),
    "etc": walk('/etc', skip=('/etc/alternatives',)),
    "alternatives_not_links": sorted(set(os.listdir('/etc/alternatives')) - set(alternatives)),
    "alternatives_targets": sorted(set(alternatives.values())),
    "dev": sorted(os.listdir('/dev')),
    "proc_pids": sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
    "passwd": open('/etc/passwd').read(),
    "hostname": open('/etc/hostname').read(),
}))
"""


@needs_python
async def test_what_a_sandbox_can_read_outside_its_work_directory_is_the_allowlist(backend):
    sid = await new_sandbox(backend)
    r = await backend.exec(api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["python3", "-c",
                                                                                              INVENTORY])))
    assert r.exit_code == 0, r.stderr
    seen = json.loads(r.stdout)
    existing = {p for p in SYSTEM_TREES if os.path.lexists("/" + p)}
    assert set(seen["top"]) == existing | {"dev", "proc", "tmp", "etc", "workspace"}
    assert set(seen["etc"]) <= ETC_ALLOWED, set(seen["etc"]) - ETC_ALLOWED
    assert {"passwd", "group", "hosts", "resolv.conf", "nsswitch.conf"} <= set(seen["etc"])
    assert set(seen["alternatives_not_links"]) <= {"README"}  # Debian's note on what the directory is
    # the alternatives only point at programs inside the system trees (or at other alternatives)
    assert all(t.split("/")[1] in existing | {"etc"} for t in seen["alternatives_targets"]), seen["alternatives_targets"]
    assert set(seen["dev"]) <= DEV_ALLOWED, set(seen["dev"]) - DEV_ALLOWED
    assert len(seen["proc_pids"]) <= 3  # bwrap's init and python: nothing of the host's
    # the sandbox's users, not the host's
    assert seen["passwd"].splitlines()[0] == "root:x:0:0:sandbox:/workspace:/bin/sh"
    host_users = {line.split(":")[0] for line in open("/etc/passwd")} - {"root", "nobody"}
    assert host_users and not {line.split(":")[0] for line in seen["passwd"].splitlines()} & host_users
    assert seen["hostname"] == "sandbox\n"


async def test_a_link_to_etc_passwd_reads_the_sandboxs_own_file(backend):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "ln -s /etc/passwd p; cat p; ls /etc/shadow /etc/ssh 2>&1 | wc -l; awk 'BEGIN{print 7*6}'")
    lines = r.stdout.decode().splitlines()
    assert lines[0].startswith("root:x:0:0:sandbox:") and len(lines) == 4, lines  # passwd has 2 lines
    assert lines[2] == "2"  # both missing (two error lines)
    assert lines[3] == "42"  # programs behind /etc/alternatives still run


async def test_listing_etc_in_host_paths_shows_the_hosts_etc(state_root, events):
    backend = BwrapBackend(make_config(state_root, host_paths=[*DEFAULT_HOST_PATHS, "/etc"]), events)
    await backend.start()
    try:
        sid = await new_sandbox(backend)
        r = await sh(backend, sid, "cat /etc/hostname")
        assert r.stdout == open("/etc/hostname", "rb").read()
    finally:
        await backend.close()
