"""Gang start: a run's services start all at once or not at all.

Every member registers through its heartbeat (KV ``rlbus_members``, state
``waiting``) and holds nothing expensive while it waits. Whoever first sees every
role at its quorum admits the run with an atomic create of KV ``rlbus_runs`` key
``<run>.gang`` (compare-and-set on absence: one admission, however many try); if
the deadline passes first, the run is marked failed the same way, naming the
roles that were missing, and every member releases and exits. Runs only count
their own members, so two runs on one bus never wait on each other.
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


def gang_key(run_id: str) -> str:
    return f"{run_id}.gang"


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


async def read_state(runs_kv: Any, run_id: str) -> GangState | None:
    try:
        entry = await runs_kv.get(gang_key(run_id))
    except KeyNotFoundError:
        return None
    if entry.value is None or not entry.value:
        return None
    return codec.decode(entry.value, GangState, max_bytes=None)


async def barrier(js: Any, run_id: str, gang: GangSection, poll_s: float = 0.5) -> GangState | None:
    """Wait until the run is admitted (returns its state) or raise :class:`GangFailed`."""
    if not gang.roles:
        return None
    from services.runtime.bus import ensure_kv

    runs_kv = await ensure_kv(js, catalog.RUNS)
    await ensure_kv(js, catalog.MEMBERS)
    deadline = time.monotonic() + gang.timeout_s
    log.info("run %s: waiting for gang %s (up to %.0fs)", run_id, gang.roles, gang.timeout_s)
    while True:
        state = await read_state(runs_kv, run_id)
        if state is not None:
            if state.state == "admitted":
                return state
            raise GangFailed(run_id, state.missing)
        members = await live_members(js, run_id)
        missing = missing_roles(gang.roles, members)
        proposal: GangState | None = None
        if not missing:
            proposal = GangState(state="admitted", members=members)
        elif time.monotonic() > deadline:
            proposal = GangState(state="failed", members=members, missing=missing)
        if proposal is not None:
            try:
                await runs_kv.create(gang_key(run_id), codec.encode(proposal))
                log.info("run %s: gang %s by this member", run_id, proposal.state)
            except KeyWrongLastSequenceError:
                pass  # another member decided first: read its decision
            except Exception as e:  # e.g. "key exists" error from older servers
                log.debug("gang create raced: %s", e)
            continue
        await asyncio.sleep(poll_s)  # membership changes arrive via heartbeats; re-check on this period


async def reset(js: Any, run_id: str) -> None:
    """Forget a previous gang decision (a fresh launch of the run forms a new gang)."""
    from services.runtime.bus import ensure_kv

    runs_kv = await ensure_kv(js, catalog.RUNS)
    try:
        await runs_kv.purge(gang_key(run_id))
    except Exception as e:
        log.debug("gang reset: %s", e)
