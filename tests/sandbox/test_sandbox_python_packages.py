"""``python_packages``: what base "host" shows of this Python's packages and what every exec gets, and the
start-up check that the sandbox's python3 is this Python's minor version (pure functions; the sandboxed run
of mini-swe-agent is tests/agentic/test_mini_swe_agent.py)."""

from __future__ import annotations

import sysconfig

import pytest

from services.sandbox import host
from services.sandbox.backend import BackendUnavailable
from services.sandbox.config import SandboxConfig


def test_off_by_default_and_on_it_binds_this_pythons_site_packages_read_only():
    assert host.python_package_dirs(SandboxConfig()) == [] and host.python_env(SandboxConfig()) == {}
    cfg = SandboxConfig(python_packages=True)
    dirs = host.python_package_dirs(cfg)
    assert sysconfig.get_paths()["purelib"] in dirs
    # each is bound read-only at a top-level path of its own, which the sandbox's /tmp, /dev/shm and work
    # directory cannot hide (a checkout, and its .venv, under /tmp)
    inside = [f"{host.SANDBOX_PACKAGES}/{i}" for i in range(len(dirs))]
    assert host.python_env(cfg) == {"PYTHONPATH": ":".join(inside)}
    args = host.base_args(cfg, "host", "/nonexistent-etc")
    for d, path in zip(dirs, inside, strict=True):
        assert ["--ro-bind", d, path] == args[args.index(d) - 1: args.index(d) + 2]


def test_a_sandbox_python_of_another_version_is_refused_naming_both(monkeypatch):
    # a patch, not a real host: a python3 of another minor version cannot be installed beside this one here
    real = host.os.path.realpath
    monkeypatch.setattr(host.os.path, "realpath", lambda p: "/usr/bin/python3.9" if p.endswith("python3") else real(p))
    with pytest.raises(BackendUnavailable, match=r"sandboxes run /usr/bin/python3\.9, but this service's packages are for python3\.\d+"):
        host.check_sandbox_python(SandboxConfig(python_packages=True))
    host.check_sandbox_python(SandboxConfig())  # off: nothing checked
