"""Gang start: a run's services start all at once or not at all.

Every member registers through its heartbeat (KV ``rlbus_members``, state
``waiting``) and holds nothing expensive while it waits. A member that sees every
role at its quorum proposes admission with an atomic create of its *own role's*
key ``<run>.gang.<role>`` of KV ``rlbus_runs`` (compare-and-set on absence: one
proposal per role, however many instances try); if the deadline passes first, it
proposes ``failed`` the same way, naming the roles that were missing.

The decision is the proposal stored first (the lowest KV revision among the
run's ``<run>.gang.*`` keys): the bucket's stream orders every write, so every
member and ``rlbus status`` read the same decision, and members follow it
(admitted: they start; failed: they release and exit). Each role may write only
its own key (the NATS permissions, ``services/launcher/permissions.py``), so a
role's credentials cannot overwrite the record another role wrote, and a late
write to its own key comes after the decision and changes nothing. Runs only
count their own members, so two runs on one bus never wait on each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any, Literal

import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError

from proto import catalog, codec
from proto.membership import Heartbeat
from services.runtime import bus

log = logging.getLogger("rlbus.gang")

#: exit code of a member whose gang failed (the launcher does not restart it)
GANG_FAILED_EXIT = 3


class GangSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Section ``[gang]``: the roles a run needs before any of them starts working."""

    #: minimum live instances per role, e.g. { trainer = 1, rollout = 2, judge = 1 }; empty: no gang
    roles: dict[str, Annotated[int, msgspec.Meta(ge=1)]] = {}
    #: seconds to wait for the quorum before the run is marked failed
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0


class GangState(msgspec.Struct, kw_only=True):
    state: Literal["admitted", "failed"]
    members: dict[str, list[str]] = {}
    missing: dict[str, int] = {}
    at: float = msgspec.field(default_factory=time.time)


class GangFailed(RuntimeError):
    def __init__(self, run_id: str, missing: dict[str, int]) -> None:
        self.missing = missing
        what = ", ".join(f"{role} needs {n} more" for role, n in sorted(missing.items()))
        super().__init__(f"run {run_id}: gang not admitted ({what}); releasing")


class Decision(msgspec.Struct, kw_only=True):
    """The run's gang decision and the later proposals that disagree with it (ignored: too late)."""

    state: GangState
    #: the role whose proposal came first
    by: str
    revision: int
    #: role -> state of later proposals that disagree (e.g. a "failed" written after admission)
    ignored: dict[str, str] = {}
    #: every role with a stored proposal (its own, or its endorsement of the decision)
    proposers: list[str] = []


def gang_key(run_id: str, role: str) -> str:
    """The key of ``role``'s proposal in KV ``rlbus_runs`` (only that role may write it)."""
    return f"{run_id}.gang.{role}"


def gang_prefix(run_id: str) -> str:
    return f"{run_id}.gang."


async def live_members(js: Any, run_id: str) -> dict[str, list[str]]:
    """Instances per role of this run, from the membership KV (expired members have vanished)."""
    kv = await js.key_value(catalog.MEMBERS.bucket)
    try:
        keys = await bus.kv_keys(js, catalog.MEMBERS.bucket, f"{run_id}.")
    except NoKeysError:
        return {}
    out: dict[str, list[str]] = {}
    for key in keys:
        try:
            entry = await kv.get(key)
            hb = codec.decode(entry.value, Heartbeat, max_bytes=None)
        except (KeyNotFoundError, KeyDeletedError, codec.DecodeError) as e:
            log.debug("member %s unreadable: %s", key, e)
            continue
        if hb.state in ("waiting", "running"):
            out.setdefault(hb.service, []).append(hb.instance)
    return out


def missing_roles(roles: dict[str, int], members: dict[str, list[str]]) -> dict[str, int]:
    return {r: n - len(members.get(r, [])) for r, n in roles.items() if len(members.get(r, [])) < n}


async def decision(js: Any, run_id: str) -> Decision | None:
    """The run's gang decision: the first stored proposal (lowest revision) of any role; None while undecided.
    A proposal that does not decode is skipped (logged): it decides nothing."""
    runs_kv = await js.key_value(catalog.RUNS.bucket)
    try:
        keys = await bus.kv_keys(js, catalog.RUNS.bucket, gang_prefix(run_id))
    except NoKeysError:
        return None
    proposals: list[tuple[int, str, GangState]] = []
    for key in keys:
        role = key[len(gang_prefix(run_id)):]
        try:
            entry = await runs_kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        if not entry.value:
            continue
        try:
            proposals.append((entry.revision or 0, role, codec.decode(entry.value, GangState, max_bytes=None)))
        except codec.DecodeError as e:
            log.warning("run %s: gang proposal of %s does not decode, ignored: %s", run_id, role, e)
    if not proposals:
        return None
    proposals.sort(key=lambda p: p[0])
    revision, by, state = proposals[0]
    ignored = {role: st.state for _, role, st in proposals[1:] if st.state != state.state}
    return Decision(state=state, by=by, revision=revision, ignored=ignored,
                    proposers=[role for _, role, _ in proposals])


async def read_state(js: Any, run_id: str) -> GangState | None:
    """The decided gang state of the run (see :func:`decision`), None while undecided."""
    d = await decision(js, run_id)
    return None if d is None else d.state


async def barrier(js: Any, run_id: str, role: str, gang: GangSection, poll_s: float = 0.5) -> GangState | None:
    """Wait until the run is admitted (returns its state) or raise :class:`GangFailed`; ``role`` is this
    member's (its proposals go to ``<run>.gang.<role>``)."""
    if not gang.roles:
        return None
    from services.runtime.bus import ensure_kv

    runs_kv = await ensure_kv(js, catalog.RUNS)
    await ensure_kv(js, catalog.MEMBERS)
    deadline = time.monotonic() + gang.timeout_s
    log.info("run %s: waiting for gang %s (up to %.0fs)", run_id, gang.roles, gang.timeout_s)
    while True:
        decided = await decision(js, run_id)
        if decided is not None:
            if role not in decided.proposers:
                await _propose(runs_kv, run_id, role, decided.state, endorse=True)
            if decided.state.state == "admitted":
                return decided.state
            raise GangFailed(run_id, decided.state.missing)
        members = await live_members(js, run_id)
        missing = missing_roles(gang.roles, members)
        proposal: GangState | None = None
        if not missing:
            proposal = GangState(state="admitted", members=members)
        elif time.monotonic() > deadline:
            proposal = GangState(state="failed", members=members, missing=missing)
        if proposal is not None:
            await _propose(runs_kv, run_id, role, proposal, endorse=False)
            continue
        await asyncio.sleep(poll_s)  # membership changes arrive via heartbeats; re-check on this period


async def _propose(runs_kv: Any, run_id: str, role: str, state: GangState, *, endorse: bool) -> None:
    """Create ``<run>.gang.<role>`` (once: a second member of the role finds it there). Endorsing the decision
    another role stored first puts it on record under every role's key, so a later overwrite of the first
    proposer's own key (by its credentials) comes after the endorsements and decides nothing."""
    try:
        await runs_kv.create(gang_key(run_id, role), codec.encode(state))
        log.info("run %s: gang %s %s by this member (%s)", run_id, state.state,
                 "endorsed" if endorse else "proposed", role)
    except KeyWrongLastSequenceError:
        pass  # another member of this role wrote first: read the decision
    except Exception as e:  # e.g. "key exists" error from older servers
        log.debug("gang create raced: %s", e)


async def reset(js: Any, run_id: str) -> None:
    """Forget a previous gang decision (a fresh launch of the run forms a new gang): every role's proposal.
    Only the launcher may (it may write every key of the run)."""
    from services.runtime.bus import ensure_kv

    runs_kv = await ensure_kv(js, catalog.RUNS)
    try:
        keys = await bus.kv_keys(js, catalog.RUNS.bucket, gang_prefix(run_id))
    except Exception as e:
        log.debug("gang reset: %s", e)
        return
    for key in keys:
        try:
            await runs_kv.purge(key)
        except Exception as e:
            log.debug("gang reset of %s: %s", key, e)
