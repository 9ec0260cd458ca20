"""The sandbox service's admission with a warm pool: pooled sandboxes a create may take or evict do not block it,
and the pool refills only while admission is easy (pure bookkeeping, no bus)."""

from __future__ import annotations

import time

from nats.aio.msg import Msg

from services.sandbox.admission import Admission, Job


def _create() -> Job:
    return Job(msg=Msg(_client=None, subject="create"), role="create", deadline=time.time() + 60)  # type: ignore[arg-type]


def test_pooled_sandboxes_free_to_take_leave_room_for_a_create():
    held = {"live": 4, "spare": 2}  # 2 in use, 2 pooled
    adm = Admission(max_in_flight=100, max_creating=2, max_queued_creates=4, max_sandboxes=4, retry_after_s=0.5,
                    live=lambda: held["live"], spare=lambda: held["spare"])
    assert adm.offer(_create()) is True  # takes a pooled one, or evicts one to make room
    assert adm.offer(_create()) is True
    refusal = adm.offer(_create())  # 2 in use + 2 creating: full, whatever the pool holds
    assert refusal is not True and refusal is not False and "max_sandboxes = 4" in refusal.message
    held["spare"] = 0
    adm2 = Admission(max_in_flight=100, max_creating=2, max_queued_creates=4, max_sandboxes=4, retry_after_s=0.5,
                     live=lambda: held["live"], spare=lambda: held["spare"])
    assert adm2.offer(_create()) is not True  # no pooled sandbox to give up: 4 held is full


def test_the_pool_refills_only_while_admission_is_easy():
    live = {"n": 0}
    adm = Admission(max_in_flight=4, max_creating=1, max_queued_creates=4, max_sandboxes=10, retry_after_s=0.5,
                    live=lambda: live["n"])
    assert adm.pressure() is None
    first = _create()
    assert adm.offer(first) is True
    assert "create slot" in adm.pressure()  # the one create slot is busy
    assert adm.offer(_create()) is False  # queued
    assert "queued" in adm.pressure()
    ready, _ = adm.done(first)
    adm.done(ready[0])
    assert adm.pressure() is None
    live["n"] = 9
    assert "max_sandboxes" in adm.pressure()  # one more would leave no room for a create
    live["n"] = 0
    for _ in range(2):
        adm.offer(Job(msg=Msg(_client=None, subject="x"), role="instance", deadline=time.time() + 60))  # type: ignore[arg-type]
    assert "requests in progress" in adm.pressure()  # half of max_in_flight
