"""What the deploy tests share: the repository's deploy files, the CLI's parser, and the offline validators
(kubectl from Debian, kubernetes-validate and SkyPilot in .venv-deploy, made by ``./rlbus setup deploy``).
A missing validator fails the test that needs it and says how to install it; nothing is skipped."""

from __future__ import annotations

import re
import shlex
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from services.launcher import registry
from services.launcher.cli import COMMANDS, build_parser
from services.runtime.config import load_service_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DEPLOY_VENV = ROOT / ".venv-deploy"
#: the Kubernetes schema version the manifests are validated against (Debian's kubectl is v1.32)
K8S_SCHEMA_VERSION = "1.32.0"


def tool(path_or_name: str, how: str) -> str:
    """The validator's path; a clear failure (not a skip) when it is missing."""
    found = shutil.which(path_or_name) if "/" not in path_or_name else (
        path_or_name if Path(path_or_name).is_file() else None)
    if not found:
        pytest.fail(f"{path_or_name} is missing: {how}", pytrace=False)
    return found


def deploy_python() -> str:
    return tool(str(DEPLOY_VENV / "bin" / "python"), "run ./rlbus setup deploy (creates .venv-deploy)")


def launcher_services(run_file: Path) -> set[str]:
    """Every service part a run file's [launcher] services starts (trainer+rollout counts as both)."""
    tree = tomllib.loads(run_file.read_text())
    return {part for name, n in tree["launcher"]["services"].items() if n > 0 for part in name.split("+")}


def check_command(argv: list[str], *, service: str | None = None) -> Any:
    """``argv`` (after ``rlbus``) parses with the CLI, names a command it has and, for ``service NAME``,
    a service it can run; returns the parsed arguments."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"rlbus {' '.join(argv)}: the CLI refuses these arguments", pytrace=False)
    assert args.command in COMMANDS, argv
    if args.command == "service":
        for part in args.name.split("+"):
            assert part in registry.names(), f"rlbus service {part}: no such service"
        if service is not None:
            assert args.name == service, f"{argv} runs {args.name}, expected {service}"
    if args.command == "status" and args.healthy and service is not None:
        assert args.healthy == service, f"the health check of {service} checks {args.healthy}"
    return args


def check_env(service: str, run_file: Path, env: dict[str, str]) -> None:
    """The RLBUS__ variables of ``service`` are config keys its config accepts (ConfigError otherwise)."""
    cls, _ = registry.load(service)
    load_service_config(service, cls, run_file, env={k: v for k, v in env.items() if k.startswith("RLBUS__")})


_VAR = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-style ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` substitution."""
    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == "-":
            return arg
        raise AssertionError(f"${{{name}}} is not set ({arg or 'no default'})")
    return _VAR.sub(sub, text)


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def rlbus_lines(script: str) -> list[list[str]]:
    """The rlbus invocations of a shell script (``.venv/bin/rlbus ...`` or ``rlbus ...``), as argv after
    ``rlbus``, with shell line continuations joined and trailing ``&`` / ``; do ...`` dropped."""
    joined = script.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        m = re.search(r"(?:^|\s)(?:\S*/)?rlbus\s+(.*)", line)
        if not m or line.strip().startswith("#"):
            continue
        rest = re.split(r";\s*do\b|\s&\s*$|\s&$", m.group(1))[0]
        out.append(shlex.split(rest.rstrip("&").strip()))
    return out
