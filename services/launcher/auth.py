"""Per-service NATS users with minimal subject permissions (DESIGN.md, "Security").

Every service connects as its own user. :data:`ROLES` is the typed table of
what each one may publish and subscribe to; it is written out two ways:

* :func:`generate_auth` — for one run directory: random passwords, an
  ``authorization`` include for ``nats-server`` and a ``credentials.json``
  (all files mode 0600, directory 0700). ``rlbus up`` starts the embedded
  server with it and hands every child its user and password as ``--set``
  overrides (:meth:`Credentials.nats_overrides`).
* :func:`render_example` — ``deploy/nats/rlbus-permissions.conf``, the same
  permissions for a shared server, passwords read from environment variables.

How the grants are chosen
-------------------------
Streams, consumers and buckets are reached through JetStream API subjects, so
the grants name those too: stream creation only for the streams the shared
harness provisions (``STREAM.CREATE.<name>``; an existing stream with the same
configuration is left alone, a changed one needs ``STREAM.UPDATE``, which only
the launcher has), consumer creation, ``MSG.NEXT`` and ``$JS.ACK`` only for a
service's own durable consumer (named ``<role>-<run>``), KV and object-store
access bucket by bucket (``$KV.<bucket>.<key>`` for writes, ``DIRECT.GET`` /
``STREAM.MSG.GET`` / ephemeral consumers plus ``$JS.FC`` flow control for
reads). With ``run_id`` set, every rlbus subject, KV key and consumer name is
pinned to that run, so the users of one run cannot touch another run's work.

Private inboxes
---------------
Replies (JetStream API answers, pull-consumer deliveries, sandbox replies)
travel on inbox subjects. With the shared ``_INBOX.>`` a user could subscribe
to every other user's replies — and so read the trajectories the trainer
fetches. With ``private_inboxes=True`` (the default) each service role gets
the prefix ``_INBOX_<role>`` and may subscribe only under it; the client must
then connect with ``inbox_prefix`` (``NatsSection.inbox_prefix``). Responders
(the sandbox service) answer through ``allow_responses`` rather than a publish
grant on anyone's inbox.

Limits of subject permissions (documented, not hidden): a role that may read a
KV bucket or object store reads every run's entries in it; a role that may
purge an object-store stream (trainer, weightsync) can purge all of it; the
weightsync service may delete upstream manifests (retention) and therefore may
also write them — it cannot announce them (``<run>.latest`` and the announce
subject stay the trainer's).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import msgspec

from proto import catalog, membership, sandbox, subjects, weights

JS = "$JS.API"
SHARED_INBOX = "_INBOX"
AUTH_DIR = "auth"


class AuthError(ValueError):
    """Credentials could not be generated or loaded (the message says which file or role)."""


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    """Subjects one role may use for one purpose; ``why`` is written next to them in the config."""

    why: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    #: may publish to the reply subject of each request it receives (request/reply responders)
    allow_responses: bool = False


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    """The flattened permissions of one user."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """What grants are formatted with."""

    #: run id, or ``*`` for every run (a shared server)
    run: str = "*"
    #: inbox prefix of the role (``_INBOX`` or ``_INBOX_<role>``)
    inbox: str = SHARED_INBOX
    #: weight scopes served by weightsync relays (read by rollouts, written by weightsync)
    relay_scopes: tuple[str, ...] = ()


# --- building blocks -----------------------------------------------------------------------------


def _inbox(s: Scope) -> Grant:
    return Grant(why="replies: JetStream API answers, pull deliveries, acks of publishes", subscribe=(f"{s.inbox}.>",))


def _provision(names: Iterable[str]) -> Grant:
    return Grant(
        why="idempotent provisioning of the streams and buckets this service opens (no UPDATE/DELETE)",
        publish=(f"{JS}.STREAM.INFO.*", f"{JS}.STREAM.NAMES", *(f"{JS}.STREAM.CREATE.{n}" for n in names)),
    )


def _harness(role: str, s: Scope) -> list[Grant]:
    """What the shared harness does for every service: provision, heartbeat, metrics, dead letters."""
    catalog_streams = [*catalog.STREAMS, *(f"KV_{b}" for b in catalog.KV_BUCKETS)]
    return [
        _inbox(s),
        _provision(catalog_streams),
        Grant(why="heartbeats (subject and own membership keys) and metrics", publish=(
            f"rlbus.{s.run}.{membership.FAMILY}.{role}",
            f"$KV.{membership.MEMBERS_BUCKET}.{s.run}.{role}.>",
            f"rlbus.{s.run}.metrics.{role}",
        )),
        Grant(why="dead letters with the reason", publish=(f"rlbus.{s.run}.dlq.>",)),
        _stream_read(f"KV_{membership.MEMBERS_BUCKET}", "gang start: read the run's members"),
        _stream_read(f"KV_{catalog.RUNS.bucket}", "gang start: read the run's gang decision"),
        _publish("gang start: admit the run or mark it failed (atomic create of <run>.gang)",
                 f"$KV.{catalog.RUNS.bucket}.{s.run}.gang"),
    ]


def _durable(cdef: catalog.ConsumerDef, s: Scope) -> Grant:
    """Create, pull from and ack one durable consumer of the run (any name when the run is ``*``)."""
    name = "*" if s.run == "*" else cdef.durable.format(run=s.run)
    st = cdef.stream
    return Grant(why=f"own durable consumer {cdef.durable} on {st}: create, fetch, ack", publish=(
        f"{JS}.CONSUMER.DURABLE.CREATE.{st}.{name}",
        f"{JS}.CONSUMER.CREATE.{st}.{name}",
        f"{JS}.CONSUMER.CREATE.{st}.{name}.>",
        f"{JS}.CONSUMER.INFO.{st}.{name}",
        f"{JS}.CONSUMER.MSG.NEXT.{st}.{name}",
        f"$JS.ACK.{st}.{name}.>",
    ))


def _stream_read(stream: str, why: str) -> Grant:
    """Read a stream with ephemeral consumers and single-message gets (KV get/watch, object reads)."""
    return Grant(why=why, publish=(
        f"{JS}.DIRECT.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}.>",
        f"{JS}.STREAM.MSG.GET.{stream}",
        f"{JS}.CONSUMER.CREATE.{stream}",
        f"{JS}.CONSUMER.CREATE.{stream}.>",
        f"{JS}.CONSUMER.INFO.{stream}.*",
        f"{JS}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{JS}.CONSUMER.DELETE.{stream}.*",
        f"$JS.FC.{stream}.>",
    ))


def _weights_read(scope: str, s: Scope, *, claim_ranks: bool) -> list[Grant]:
    kv, obj = weights.kv_bucket(scope), weights.object_bucket(scope)
    grants = [
        _provision([f"KV_{kv}", f"OBJ_{obj}"]),
        _stream_read(f"KV_{kv}", f"weight versions of scope {scope}: get, watch"),
        _stream_read(f"OBJ_{obj}", f"weight chunks of scope {scope}: read"),
        Grant(why="weightsync's fast chunk reader (rawpull.py) receives chunks on _INBOX.rlbus.<random>; "
                  "only weight chunks travel there", subscribe=("_INBOX.rlbus.>",)),
        Grant(why=f"weight announcements of scope {scope}", subscribe=(
            f"rlbus.{s.run}.{weights.FAMILY}.announce.{scope}",
            f"rlbus.{s.run}.{weights.FAMILY}.broadcast.{scope}",
        )),
    ]
    if claim_ranks:
        grants.append(Grant(why="broadcast transport: claim a rank (never announce a version)",
                            publish=(f"$KV.{kv}.{s.run}.bcast.*.rank.*",)))
    return grants


def _weights_write(scope: str, s: Scope) -> list[Grant]:
    kv, obj = weights.kv_bucket(scope), weights.object_bucket(scope)
    return [
        *_weights_read(scope, s, claim_ranks=False),
        Grant(why=f"publish weight versions of scope {scope}: chunks, manifests, announcements", publish=(
            f"$O.{obj}.>",
            f"{JS}.STREAM.PURGE.OBJ_{obj}",
            f"$KV.{kv}.{s.run}.>",
            f"rlbus.{s.run}.{weights.FAMILY}.announce.{scope}",
            f"rlbus.{s.run}.{weights.FAMILY}.broadcast.{scope}",
        )),
    ]


def _sandbox_client(s: Scope) -> Grant:
    return Grant(why="sandbox API requests (replies come back on the own inbox)", publish=(
        f"rlbus.{s.run}.{sandbox.FAMILY}.api.>",
        f"rlbus.{s.run}.{sandbox.FAMILY}.list",
    ))


def _publish(why: str, *subjs: str) -> Grant:
    return Grant(why=why, publish=subjs)


# --- roles ---------------------------------------------------------------------------------------


def _trainer(s: Scope) -> list[Grant]:
    return [
        *_harness("trainer", s),
        _publish("prompt tickets and trajectory outcomes", f"rlbus.{s.run}.prompts", f"rlbus.{s.run}.outcomes"),
        _durable(catalog.TRAINER_TRAJECTORIES, s),
        _publish("run state", f"$KV.{catalog.RUNS.bucket}.{s.run}.>"),
        *_weights_write(weights.MAIN_SCOPE, s),
    ]


def _rollout(s: Scope) -> list[Grant]:
    reads = [g for scope in (weights.MAIN_SCOPE, *s.relay_scopes) for g in _weights_read(scope, s, claim_ranks=True)]
    return [
        *_harness("rollout", s),
        _durable(catalog.ROLLOUT_PROMPTS, s),
        _publish("finished rollouts", f"rlbus.{s.run}.rollouts"),
        *reads,
        _sandbox_client(s),
    ]


def _judge(s: Scope) -> list[Grant]:
    return [
        *_harness("judge", s),
        _durable(catalog.JUDGE_ROLLOUTS, s),
        _publish("scored trajectories (the judge is their only publisher)", f"rlbus.{s.run}.trajectories"),
        _sandbox_client(s),
    ]


def _sandbox(s: Scope) -> list[Grant]:
    events = str(sandbox.SANDBOX_EVENTS_STREAM["name"])
    return [
        *_harness("sandbox", s),
        Grant(why="serve the sandbox API; answer each request once on its reply subject", subscribe=(
            f"rlbus.{s.run}.{sandbox.FAMILY}.api.>",
            f"rlbus.{s.run}.{sandbox.FAMILY}.list",
        ), allow_responses=True),
        _provision([events]),
        _publish("sandbox lifecycle events", f"rlbus.{s.run}.{sandbox.FAMILY}.events.>"),
    ]


def _weightsync(s: Scope) -> list[Grant]:
    main_kv, main_obj = weights.kv_bucket(weights.MAIN_SCOPE), weights.object_bucket(weights.MAIN_SCOPE)
    return [
        *_harness("weightsync", s),
        *_weights_read(weights.MAIN_SCOPE, s, claim_ranks=False),
        _publish("retention of the trainer's versions: delete manifests and chunks (never announce)",
                 f"$KV.{main_kv}.{s.run}.v.*", f"{JS}.STREAM.PURGE.OBJ_{main_obj}"),
        *[g for scope in s.relay_scopes for g in _weights_write(scope, s)],
    ]


def _echo(s: Scope) -> list[Grant]:
    return [
        *_harness("echo", s),
        _durable(catalog.ECHO_IN, s),
        _publish("echo replies", f"rlbus.{s.run}.echo.out"),
    ]


def _admin(s: Scope) -> list[Grant]:
    return [
        _inbox(s),
        Grant(why="read every rlbus subject live (rlbus tap)", subscribe=("rlbus.>",)),
        Grant(why="read streams, consumers and buckets (rlbus tap --from-start, rlbus status)", publish=(
            f"{JS}.INFO",
            f"{JS}.STREAM.INFO.*",
            f"{JS}.STREAM.NAMES",
            f"{JS}.STREAM.LIST",
            f"{JS}.CONSUMER.INFO.*.*",
            f"{JS}.CONSUMER.NAMES.*",
            f"{JS}.CONSUMER.LIST.*",
            f"{JS}.CONSUMER.CREATE.*",
            f"{JS}.CONSUMER.CREATE.*.>",
            f"{JS}.DIRECT.GET.>",
            f"{JS}.STREAM.MSG.GET.*",
            "$JS.FC.>",
        )),
        _publish("list sandboxes (rlbus status)", f"rlbus.{s.run}.{sandbox.FAMILY}.list"),
    ]


def _launcher(s: Scope) -> list[Grant]:
    return [
        *_admin(s),
        Grant(why="provision and repair streams, consumers and buckets (the launcher owns the server)",
              publish=(f"{JS}.>", "$JS.ACK.>")),
        _publish("gang state and membership (admission, release)",
                 f"$KV.{catalog.RUNS.bucket}.{s.run}.>", f"$KV.{membership.MEMBERS_BUCKET}.{s.run}.>"),
        _publish("drive the echo demo", f"rlbus.{s.run}.echo.in"),
    ]


class Role(msgspec.Struct, frozen=True, kw_only=True):
    """One NATS user: what it is for, its grants, and whether it gets a private inbox prefix."""

    description: str
    grants: Callable[[Scope], list[Grant]]
    private_inbox: bool = True


#: Roles → grants. Service roles are named like the services (heartbeat and membership
#: subjects carry the service name); ``admin`` is the read-only CLI, ``launcher`` the supervisor.
ROLES: dict[str, Role] = {
    "trainer": Role(description="owns the policy: prompts, weight versions, outcomes; reads trajectories",
                    grants=_trainer),
    "rollout": Role(description="generates: reads prompts and weights, publishes rollouts, uses sandboxes",
                    grants=_rollout),
    "judge": Role(description="grades: reads rollouts, publishes trajectories, uses sandboxes", grants=_judge),
    "sandbox": Role(description="serves the sandbox API and publishes lifecycle events; reads no work streams",
                    grants=_sandbox),
    "weightsync": Role(description="retention of the trainer's versions; relays them into its own scopes",
                       grants=_weightsync),
    "echo": Role(description="the echo demo worker", grants=_echo),
    "admin": Role(description="read-only operator (rlbus tap, rlbus status)", grants=_admin, private_inbox=False),
    "launcher": Role(description="the supervisor: provisions the server, records gang state, reads everything",
                     grants=_launcher, private_inbox=False),
}

#: roles every bundle gets besides the services it names
ALWAYS = ("launcher", "admin")


def role_spec(role: str) -> Role:
    spec = ROLES.get(role)
    if spec is None:
        raise AuthError(f"no NATS permissions are defined for service {role!r}; add a role to ROLES in "
                        f"services/launcher/auth.py (known: {', '.join(sorted(ROLES))})")
    return spec


def inbox_prefix(role: str, private_inboxes: bool = True) -> str:
    """``_INBOX_<role>`` for a service role with private inboxes, else ``_INBOX``."""
    return f"{SHARED_INBOX}_{role}" if private_inboxes and role_spec(role).private_inbox else SHARED_INBOX


def grants_for(role: str, run_id: str = "*", relay_scopes: Sequence[str] = (),
               private_inboxes: bool = True) -> list[Grant]:
    """The grants of ``role`` formatted for one run (``*``: every run)."""
    if run_id != "*":
        subjects.check_run_id(run_id)
    scopes = tuple(weights.check_scope(x) for x in relay_scopes)
    if weights.MAIN_SCOPE in scopes:
        raise AuthError(f"relay scope {weights.MAIN_SCOPE!r} is the trainer's own scope; relays need their own")
    return role_spec(role).grants(Scope(run=run_id, inbox=inbox_prefix(role, private_inboxes), relay_scopes=scopes))


def permissions(grants: Iterable[Grant]) -> Permissions:
    """Flatten grants into one user's allow lists (order kept, duplicates dropped)."""
    pub: dict[str, None] = {}
    sub: dict[str, None] = {}
    responses = False
    for g in grants:
        pub.update(dict.fromkeys(g.publish))
        sub.update(dict.fromkeys(g.subscribe))
        responses = responses or g.allow_responses
    return Permissions(publish=tuple(pub), subscribe=tuple(sub), allow_responses=responses)


# --- rendering -----------------------------------------------------------------------------------


def _q(text: str) -> str:
    return json.dumps(text)


def _render_user(role: str, user: str, password: str, grants: list[Grant], indent: str = "    ") -> list[str]:
    """One user block in nats-server config syntax; ``password`` is inserted verbatim (quoted or $VAR)."""
    perms = permissions(grants)
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
# GENERATED from services/launcher/auth.py (ROLES) by
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


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
