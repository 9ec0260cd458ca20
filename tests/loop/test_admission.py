"""Admission control and the staleness filter, as pure bookkeeping."""

from __future__ import annotations

import pytest

from services.trainer.admission import Admission, AdmissionError, GroupBuffer, Sample, is_stale
from services.trainer.config import TrainerConfig


def test_staleness_filter_boundary():
    assert not is_stale(sample_version=5, current_version=5, max_staleness=0)
    assert is_stale(sample_version=4, current_version=5, max_staleness=0)
    assert not is_stale(sample_version=3, current_version=5, max_staleness=2)
    assert is_stale(sample_version=2, current_version=5, max_staleness=2)


def test_in_flight_bound_is_staleness_plus_one_times_groups():
    assert TrainerConfig(groups_per_step=4, max_staleness=0).max_groups_in_flight == 4
    assert TrainerConfig(groups_per_step=4, max_staleness=2).max_groups_in_flight == 12


def test_admission_never_exceeds_bound():
    a = Admission(max_in_flight=3)
    for i in range(3):
        a.admit(f"g{i}", version=0)
    assert a.room() == 0
    with pytest.raises(AdmissionError):
        a.admit("g3", version=0)
    a.finish("g1")
    assert a.room() == 1
    a.admit("g3", version=1)
    assert a.peak == 3 and set(a.state()) == {"g0", "g2", "g3"}


def _s(group: str, idx: int, version: int = 0) -> Sample:
    return Sample(key=f"{group}-{idx}", group_id=group, sample_index=idx, version=version, item=(group, idx))


def test_group_buffer_hands_out_complete_groups_oldest_first():
    b = GroupBuffer()
    b.add(_s("a", 0), 2)
    b.add(_s("b", 0), 2)
    b.add(_s("b", 1), 2)
    b.add(_s("a", 1), 2)
    b.add(_s("c", 0), 2)
    assert b.complete_groups() == ["a", "b"]
    taken = b.take(1)
    assert [s.item for s in taken[0]] == [("a", 0), ("a", 1)]
    assert b.complete_groups() == ["b"] and b.pending_samples() == 3


def test_duplicate_sample_is_displaced_not_double_counted():
    b = GroupBuffer()
    first = _s("a", 0)
    assert b.add(first, 2) is None
    assert b.add(_s("a", 0), 2) is first
    assert b.pending_samples() == 1


def test_stale_groups_are_found_and_dropped():
    b = GroupBuffer()
    b.add(_s("old", 0, version=1), 2)
    b.add(_s("new", 0, version=3), 2)
    assert b.stale_groups(current_version=3, max_staleness=1) == ["old"]
    dropped = b.drop_group("old")
    assert [s.key for s in dropped] == ["old-0"]
    assert "old" in b.dropped_groups and b.pending_samples() == 1


def test_overdue_groups_are_reported():
    a = Admission(max_in_flight=2)
    a.admit("g0", version=0)
    a.admitted_at["g0"] -= 100.0
    a.admit("g1", version=0)
    assert a.overdue(50.0) == ["g0"]
    a.finish("g0")
    assert a.overdue(50.0) == []
