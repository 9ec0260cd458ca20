"""Per-service NATS users for a run: generated passwords and the nats-server config (least privilege per role).

Every service connects as its own user with the minimal permissions of its role
(the table is :mod:`services.launcher.permissions`). That table is written out two ways:

* :func:`generate_auth` — for one run directory: random passwords, an
  ``authorization`` include for ``nats-server`` and a ``credentials.json``
  (all files mode 0600, directory 0700). ``rlbus up`` starts the embedded
  server with it and hands every child its login as ``--set`` overrides
  (:meth:`Credentials.nats_overrides`).
* :func:`render_example` — ``deploy/nats/rlbus-permissions.conf``, the same
  permissions for a shared server, passwords read from environment variables
  (``python -m services.launcher.auth`` prints it).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from services.launcher.permissions import (
    ALWAYS,
    ROLES,
    SHARED_INBOX,
    AuthError,
    Grant,
    flatten,
    grants_for,
    inbox_prefix,
    role_spec,
)

AUTH_DIR = "auth"


# --- rendering -----------------------------------------------------------------------------------


def _q(text: str) -> str:
    return json.dumps(text)


def _render_user(role: str, user: str, password: str, grants: list[Grant], indent: str = "    ") -> list[str]:
    """One user block in nats-server config syntax; ``password`` is inserted verbatim (quoted or $VAR)."""
    perms = flatten(grants)
    lines = [f"{indent}# {role}: {role_spec(role).description}", f"{indent}{{",
             f"{indent}  user: {_q(user)}", f"{indent}  password: {password}", f"{indent}  permissions: {{"]
    for kind, attr in (("publish", "publish"), ("subscribe", "subscribe")):
        lines.append(f"{indent}    {kind}: {{")
        lines.append(f"{indent}      allow: [")
        seen: set[str] = set()
        for g in grants:
            new = [x for x in getattr(g, attr) if x not in seen]
            if not new:
                continue
            lines.append(f"{indent}        # {g.why}")
            lines += [f"{indent}        {_q(x)}" for x in new]
            seen.update(new)
        if not seen:
            lines.append(f"{indent}        # nothing")
        lines.append(f"{indent}      ]")
        lines.append(f"{indent}    }}")
    if perms.allow_responses:
        lines.append(f"{indent}    # may answer each request it receives once, on that request's reply subject")
        lines.append(f"{indent}    allow_responses: true")
    lines += [f"{indent}  }}", f"{indent}}}"]
    return lines


def render_authorization(users: Sequence[tuple[str, str, str, list[Grant]]]) -> str:
    """An ``authorization { users = [...] }`` block for (role, user, password expression, grants)."""
    lines = ["authorization {", "  users = ["]
    for role, user, password, grants in users:
        lines += _render_user(role, user, password, grants)
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


EXAMPLE_HEADER = """\
# rlbus: one NATS user per service with the minimal subject permissions it needs.
#
# GENERATED from services/launcher/permissions.py (ROLES) by
#     python -m services.launcher.auth > deploy/nats/rlbus-permissions.conf
# do not edit by hand; tests/security checks that the two agree.
#
# Use it from the server config (deploy/nats/nats.conf):
#     include "rlbus-permissions.conf"
# Passwords come from the environment of nats-server (never stored here):
#     RLBUS_TRAINER_PASSWORD, RLBUS_ROLLOUT_PASSWORD, ... (one per user below).
# Each service then connects with [nats] user / password of its role, and with
# inbox_prefix = "_INBOX_<role>" (private inboxes: no service can read another's replies).
# `rlbus up` does all of this itself, with random passwords and permissions pinned to its run.
#
# These permissions are for every run on the server (run id "*"). Relay scopes of
# weightsync (here: "relay") must be listed: NATS wildcards match whole tokens only.
"""

EXAMPLE_TLS = """\
# --- TLS: required for any connection that leaves the host ---------------------------------
# Clients: set [nats] url = "tls://nats.example.org:4222" and tls_ca (plus tls_cert / tls_key
# for mutual TLS) in the run file.
#
# tls {
#   cert_file: "/etc/nats/tls/server.pem"
#   key_file:  "/etc/nats/tls/server-key.pem"
#   ca_file:   "/etc/nats/tls/ca.pem"      # CA of the client certificates
#   verify:    true                        # require a client certificate (mutual TLS)
#   timeout:   2
# }
#
# Clustered servers (routes) and leaf nodes cross hosts too:
# cluster { ... tls { cert_file: ..., key_file: ..., ca_file: ..., verify: true } }
# leafnodes { ... tls { cert_file: ..., key_file: ..., ca_file: ..., verify: true } }
"""

EXAMPLE_RELAY_SCOPES = ("relay",)


def render_example() -> str:
    """The documented example config (``deploy/nats/rlbus-permissions.conf``)."""
    users = [(role, role, f"$RLBUS_{role.upper()}_PASSWORD",
              grants_for(role, "*", EXAMPLE_RELAY_SCOPES, private_inboxes=True)) for role in ROLES]
    return EXAMPLE_HEADER + "\n" + render_authorization(users) + "\n" + EXAMPLE_TLS


# --- per-run credentials -------------------------------------------------------------------------


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """One role's NATS login."""

    role: str
    user: str
    password: str
    inbox_prefix: str = SHARED_INBOX

    def nats_overrides(self) -> list[str]:
        """``--set`` values giving a service this login (``nats.user``, ``nats.password``, ``nats.inbox_prefix``)."""
        out = [f"nats.user={_q(self.user)}", f"nats.password={_q(self.password)}"]
        if self.inbox_prefix != SHARED_INBOX:
            from services.runtime.config import NatsSection

            if "inbox_prefix" not in NatsSection.__struct_fields__:
                raise AuthError(
                    f"role {self.role} uses the private inbox prefix {self.inbox_prefix!r} but NatsSection has no "
                    "inbox_prefix field; add it (passed to nats.connect) or generate with private_inboxes=False"
                )
            out.append(f"nats.inbox_prefix={_q(self.inbox_prefix)}")
        return out

    def connect_kwargs(self) -> dict[str, str]:
        """Keyword arguments for ``nats.connect``."""
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}

    def url(self, base_url: str) -> str:
        """``base_url`` with the login in it (for code that only takes a URL; shared inbox roles only)."""
        scheme, sep, rest = base_url.partition("://")
        if not sep:
            raise AuthError(f"NATS URL {base_url!r} has no scheme (nats://host:port)")
        return f"{scheme}://{self.user}:{self.password}@{rest}"


class AuthBundle(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`generate_auth` wrote: pass ``server_config`` to nats-server, logins to the services."""

    directory: str
    #: a complete config for ``nats-server -c`` (includes ``include``)
    server_config: str
    #: the ``authorization`` block alone, for inclusion into another server config
    include: str
    run_id: str
    credentials: dict[str, Credentials]

    def for_role(self, role: str) -> Credentials:
        creds = self.credentials.get(role)
        if creds is None:
            raise AuthError(f"no NATS login for {role!r} in {self.directory}; generated roles: "
                            f"{', '.join(sorted(self.credentials))}")
        return creds


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` with mode 0600, atomically (a crash leaves the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    os.replace(tmp, path)


def load_auth(run_dir: str | os.PathLike[str]) -> AuthBundle:
    """The bundle :func:`generate_auth` wrote into ``run_dir``."""
    path = Path(run_dir) / AUTH_DIR / "credentials.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=AuthBundle)
    except FileNotFoundError:
        raise AuthError(f"{path} does not exist; run generate_auth (rlbus up does) first") from None
    except msgspec.DecodeError as e:
        raise AuthError(f"{path} is not a credentials file: {e}") from None


def generate_auth(
    run_dir: str | os.PathLike[str],
    roles: Iterable[str],
    *,
    run_id: str = "*",
    relay_scopes: Sequence[str] = (),
    private_inboxes: bool = True,
    max_payload: int | None = None,
    reuse: bool = True,
) -> AuthBundle:
    """Write ``<run_dir>/auth/{auth.conf,server.conf,credentials.json}`` (mode 0600) and return the logins.

    ``roles`` are the services of the run (``launcher`` and ``admin`` are always added);
    ``run_id`` pins every permission to one run (``*``: any run). ``reuse`` keeps the
    passwords of an earlier bundle in the same directory, so running services stay
    valid when the launcher restarts; the permissions are always rewritten.
    ``max_payload`` (bytes) goes into ``server.conf`` when given.
    """
    wanted = list(dict.fromkeys([*roles, *ALWAYS]))
    for role in wanted:
        role_spec(role)
    directory = Path(run_dir) / AUTH_DIR
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    old: dict[str, Credentials] = {}
    if reuse and (directory / "credentials.json").is_file():
        old = load_auth(run_dir).credentials
    creds: dict[str, Credentials] = {}
    for role in wanted:
        user = role if run_id == "*" else f"{role}-{run_id}"
        prev = old.get(role)
        password = prev.password if prev is not None and prev.user == user else secrets.token_hex(24)
        creds[role] = Credentials(role=role, user=user, password=password,
                                  inbox_prefix=inbox_prefix(role, private_inboxes))
    users = [(role, c.user, _q(c.password), grants_for(role, run_id, relay_scopes, private_inboxes))
             for role, c in creds.items()]
    include = directory / "auth.conf"
    server = directory / "server.conf"
    _write_private(include, f"# rlbus run {run_id}: generated by services/launcher/auth.py\n"
                   + render_authorization(users))
    server_lines = ["# rlbus embedded nats-server: generated by services/launcher/auth.py", 'include "auth.conf"']
    if max_payload is not None:
        server_lines.append(f"max_payload: {int(max_payload)}")
    _write_private(server, "\n".join(server_lines) + "\n")
    bundle = AuthBundle(directory=str(directory), server_config=str(server), include=str(include),
                        run_id=run_id, credentials=creds)
    _write_private(directory / "credentials.json", msgspec.json.encode(bundle).decode())
    return bundle


if __name__ == "__main__":
    print(render_example(), end="")
