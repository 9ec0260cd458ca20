"""The typed table of NATS permissions: which subjects each rlbus role may publish and subscribe to.

:data:`ROLES` maps a role (a service name, or ``admin`` / ``launcher``) to its
:class:`Grant` s, each a purpose (``why``, written next to the subjects in the
generated config) and the subjects it needs. ``services/launcher/auth.py``
turns the table into nats-server users; tests/security checks it against a real
server.

Two sources, kept apart
-----------------------
* **Channels** (:func:`channel_grants`): every subject a role publishes or
  subscribes to comes from the channel table (``proto.catalog.CHANNELS``): a role
  named among a channel's ``publishers`` may publish on it, one among its
  ``subscribers`` gets the channel's durable consumer (stream channels with a
  consumer), the subject (anything else), and ``allow_responses`` (request/reply
  channels). ``any`` is every service role. Suffix wildcards are pinned per role:
  ``{role}`` to the publisher's own name, ``{scope}`` to the weight scopes it
  writes (trainer: ``main``; weightsync: its relay scopes) or reads (``main`` and
  the relay scopes); other wildcards stay ``*``. A channel added to the table
  therefore reaches the permissions of its roles with no edit here.
* **Infrastructure** (the role functions below): inboxes, JetStream API
  subjects (provisioning, consumers, KV and object-store access), which are not
  channels.

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
reads). With a run id, every rlbus subject, KV key and consumer name is pinned
to that run, so the users of one run cannot touch another run's work. Within a
run each role writes only its own KV keys: its members' keys, its gang proposal
``<run>.gang.<role>``, and for the trainer ``<run>.state``; only the launcher
writes every key of the run (gang reset, release).

Private inboxes
---------------
Replies (JetStream API answers, pull-consumer deliveries, sandbox replies)
travel on inbox subjects. With the shared ``_INBOX.>`` a user could subscribe
to every other user's replies — and so read the trajectories the trainer
fetches. With private inboxes (the default) each service role gets the prefix
``_INBOX_<role>`` and may subscribe only under it; the client must then connect
with that ``inbox_prefix``. Responders (the sandbox service) answer through
``allow_responses`` rather than a publish grant on anyone's inbox.

Limits of subject permissions (documented, not hidden): a role that may read a
KV bucket or object store reads every run's entries in it; a role that may
purge an object-store stream (trainer, weightsync) can purge all of it; the
weightsync service may delete upstream manifests (retention) and therefore may
also write them — it cannot announce them (``<run>.latest`` and the announce
subject stay the trainer's); JetStream domains (``$JS.<domain>.API``, v2 ack
subjects) are not covered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import msgspec

from proto import catalog, membership, subjects, weights

JS = "$JS.API"
SHARED_INBOX = "_INBOX"


class AuthError(ValueError):
    """Permissions or credentials could not be made or loaded (the message says which role or file)."""


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
    """What the shared harness does for every service besides its channels: provision, membership, gang start."""
    catalog_streams = [*catalog.STREAMS, *(f"KV_{b}" for b in catalog.KV_BUCKETS)]
    return [
        _inbox(s),
        _provision(catalog_streams),
        _publish("membership: own keys in the members bucket", f"$KV.{membership.MEMBERS_BUCKET}.{s.run}.{role}.>"),
        _stream_read(f"KV_{membership.MEMBERS_BUCKET}", "gang start: read the run's members"),
        _stream_read(f"KV_{catalog.RUNS.bucket}", "gang start: read the run's gang decision"),
        _publish("gang start: propose admission or failure under the role's own key (atomic create of "
                 "<run>.gang.<role>; the first stored proposal decides, no role can overwrite another's)",
                 f"$KV.{catalog.RUNS.bucket}.{s.run}.gang.{role}"),
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
    ]
    if claim_ranks:
        grants.append(Grant(why="broadcast transport: claim a rank (never announce a version)",
                            publish=(f"$KV.{kv}.{s.run}.bcast.*.rank.*",)))
        grants.append(Grant(why="vllm transport: register (and unregister) its engine for the trainer's group",
                            publish=(f"$KV.{kv}.{s.run}.vllmxfer.engine.*",)))
    return grants


def _weights_write(scope: str, s: Scope) -> list[Grant]:
    kv, obj = weights.kv_bucket(scope), weights.object_bucket(scope)
    return [
        *_weights_read(scope, s, claim_ranks=False),
        Grant(why=f"store weight versions of scope {scope}: chunks, manifests, the latest announcement", publish=(
            f"$O.{obj}.>",
            f"{JS}.STREAM.PURGE.OBJ_{obj}",
            f"$KV.{kv}.{s.run}.>",
        )),
    ]


def _publish(why: str, *subjs: str) -> Grant:
    return Grant(why=why, publish=subjs)


# --- channels: derived from the channel table ---------------------------------------------------


def _weight_scopes_written(role: str, s: Scope) -> tuple[str, ...]:
    """The weight scopes a role publishes under: the trainer its own, weightsync its relays."""
    return {"trainer": (weights.MAIN_SCOPE,), "weightsync": s.relay_scopes}.get(role, ())


def _named(role: str, names: tuple[str, ...]) -> bool:
    spec = role_spec(role)
    return any(r in names for r in (role, *spec.acts_as)) or ("any" in names and spec.service)


def _pinned(ch: catalog.Channel, role: str, s: Scope, *, publish: bool) -> tuple[str, ...]:
    """The channel's subjects for one role: ``{role}`` → the publisher itself, ``{scope}`` → its scopes."""
    fixed = {"role": role} if publish else {}
    if "scope" not in ch.suffix:
        return (ch.wildcard(s.run, **fixed),)
    scopes = _weight_scopes_written(role, s) if publish else (weights.MAIN_SCOPE, *s.relay_scopes)
    return tuple(ch.wildcard(s.run, **fixed, scope=x) for x in scopes)


def channel_grants(role: str, s: Scope) -> list[Grant]:
    """What ``role`` may publish and subscribe to, from the publishers and subscribers of every channel."""
    grants = []
    for ch in catalog.CHANNELS.values():
        label = f"channel {ch.name.upper()}"
        if _named(role, ch.publishers) and (subjs := _pinned(ch, role, s, publish=True)):
            grants.append(Grant(why=f"{label}: publish", publish=subjs))
        if not _named(role, ch.subscribers):
            continue
        if ch.consumer is not None:
            durable = _durable(ch.consumer, s)
            grants.append(msgspec.structs.replace(durable, why=f"{label}: {durable.why}"))
        elif ch.reply_type is not None:
            grants.append(Grant(why=f"{label}: serve requests, answer each once on its reply subject",
                                subscribe=_pinned(ch, role, s, publish=False), allow_responses=True))
        else:
            grants.append(Grant(why=f"{label}: subscribe", subscribe=_pinned(ch, role, s, publish=False)))
    return grants


# --- roles: what is not a channel (inboxes, JetStream API, KV and object stores) -------------------


def _trainer(s: Scope) -> list[Grant]:
    return [
        *_harness("trainer", s),
        _publish("run state: its own key <run>.state (what a restarted trainer resumes from)",
                 f"$KV.{catalog.RUNS.bucket}.{s.run}.state"),
        *_weights_write(weights.MAIN_SCOPE, s),
    ]


def _rollout(s: Scope) -> list[Grant]:
    reads = [g for scope in (weights.MAIN_SCOPE, *s.relay_scopes) for g in _weights_read(scope, s, claim_ranks=True)]
    return [*_harness("rollout", s), *reads]


def _weightsync(s: Scope) -> list[Grant]:
    main_kv, main_obj = weights.kv_bucket(weights.MAIN_SCOPE), weights.object_bucket(weights.MAIN_SCOPE)
    return [
        *_harness("weightsync", s),
        *_weights_read(weights.MAIN_SCOPE, s, claim_ranks=False),
        _publish("retention of the trainer's versions: delete manifests and chunks (never announce)",
                 f"$KV.{main_kv}.{s.run}.v.*", f"{JS}.STREAM.PURGE.OBJ_{main_obj}"),
        *[g for scope in s.relay_scopes for g in _weights_write(scope, s)],
    ]


def _tracker(s: Scope) -> list[Grant]:
    """Follows channels with durable consumers of its own (catalog.TRACKER_READS); publishes only metrics."""
    return [*_harness("tracker", s), *(_durable(c, s) for c in catalog.TRACKER_READS.values())]


def _service(role: str) -> Callable[[Scope], list[Grant]]:
    """A service that needs nothing but the harness and its channels."""
    return lambda s: _harness(role, s)


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
    ]


def _launcher(s: Scope) -> list[Grant]:
    return [
        *_admin(s),
        Grant(why="provision and repair streams, consumers and buckets (the launcher owns the server)",
              publish=(f"{JS}.>", "$JS.ACK.>")),
        _publish("gang state and membership (admission, release)",
                 f"$KV.{catalog.RUNS.bucket}.{s.run}.>", f"$KV.{membership.MEMBERS_BUCKET}.{s.run}.>"),
    ]


class Role(msgspec.Struct, frozen=True, kw_only=True):
    """One NATS user: what it is for, its grants besides its channels, and whether it gets a private inbox."""

    description: str
    grants: Callable[[Scope], list[Grant]]
    private_inbox: bool = True
    #: a service run by the harness: ``any`` in a channel's publishers/subscribers includes it
    service: bool = True
    #: roles whose channels this role also has (the launcher does what the admin CLI does)
    acts_as: tuple[str, ...] = ()


#: Roles → grants. Service roles are named like the services (heartbeat and membership
#: subjects carry the service name); ``admin`` is the read-only CLI, ``launcher`` the supervisor.
ROLES: dict[str, Role] = {
    "trainer": Role(description="owns the policy: prompts, weight versions, outcomes; reads trajectories",
                    grants=_trainer),
    "rollout": Role(description="generates: reads prompts and weights, publishes rollouts, uses sandboxes",
                    grants=_rollout),
    "judge": Role(description="grades: reads rollouts, publishes trajectories, uses sandboxes",
                  grants=_service("judge")),
    "sandbox": Role(description="serves the sandbox API and publishes lifecycle events; reads no work streams",
                    grants=_service("sandbox")),
    "weightsync": Role(description="retention of the trainer's versions; relays them into its own scopes",
                       grants=_weightsync),
    "echo": Role(description="the echo demo worker", grants=_service("echo")),
    "teacher": Role(description="on-policy distillation: answers requests for a teacher model's logprobs",
                    grants=_service("teacher")),
    "tracker": Role(description="experiment tracking: reads metrics, trajectories and outcomes through its own "
                                "consumers; publishes only its metrics", grants=_tracker),
    "admin": Role(description="read-only operator (rlbus tap, rlbus status)", grants=_admin, private_inbox=False,
                  service=False),
    "launcher": Role(description="the supervisor: provisions the server, records gang state, reads everything",
                     grants=_launcher, private_inbox=False, service=False, acts_as=("admin",)),
}

#: roles every bundle gets besides the services it names
ALWAYS = ("launcher", "admin")


def role_spec(role: str) -> Role:
    spec = ROLES.get(role)
    if spec is None:
        raise AuthError(f"no NATS permissions are defined for service {role!r}; add a role to ROLES in "
                        f"services/launcher/permissions.py (known: {', '.join(sorted(ROLES))})")
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
    scope = Scope(run=run_id, inbox=inbox_prefix(role, private_inboxes), relay_scopes=scopes)
    return [*role_spec(role).grants(scope), *channel_grants(role, scope)]


def flatten(grants: Iterable[Grant]) -> Permissions:
    """Flatten grants into one user's allow lists (order kept, duplicates dropped)."""
    pub: dict[str, None] = {}
    sub: dict[str, None] = {}
    responses = False
    for g in grants:
        pub.update(dict.fromkeys(g.publish))
        sub.update(dict.fromkeys(g.subscribe))
        responses = responses or g.allow_responses
    return Permissions(publish=tuple(pub), subscribe=tuple(sub), allow_responses=responses)
