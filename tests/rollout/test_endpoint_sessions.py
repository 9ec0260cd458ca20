"""Session bookkeeping of the endpoint (services/rollout/sessions.py): one sequence while calls continue each
other, segments when history is rewritten, masks, choices, aborted calls, the store's limits. Pure: no HTTP."""

from __future__ import annotations

import pytest

from services.rollout.sessions import Choice, SessionLimitError, SessionStore, UnknownSessionError


def choice(ids: list[int], version: int = 3, key: str = "") -> Choice:
    return Choice(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[version] * len(ids), finish_reason="eos",
                  key=key)


def test_continuing_calls_make_one_sequence_with_only_generated_tokens_trained():
    store = SessionStore(max_sessions=4)
    s = store.open(labels={"episode": "e1"})
    first = s.begin([1, 2, 3])
    s.finish(first, [choice([10, 11])])
    second = s.begin([1, 2, 3, 10, 11, 4, 5], continues=(first, 0))
    assert second.segment == first.segment == 0 and second.new_tokens == 2  # only the new tokens prefilled
    s.finish(second, [choice([12], version=4)])
    [segment] = store.close(s.id).close()
    prompt, turns = segment.sequence()
    assert prompt == [1, 2, 3]
    assert [(t.role, t.token_ids) for t in turns] == [("assistant", [10, 11]), ("tool", [4, 5]), ("assistant", [12])]
    assert turns[0].logprobs == [-0.5, -0.5] and turns[0].versions == [3, 3] and turns[2].versions == [4]
    assert turns[1].logprobs == [] and turns[1].versions == []  # masked out of the loss
    assert segment.generated == [False] * 3 + [True] * 2 + [False] * 2 + [True]
    assert s.prefilled_tokens == 5 and s.generated_tokens == 3


def test_rewritten_history_starts_a_new_segment_and_keeps_the_old_one():
    s = SessionStore(4).open()
    first = s.begin([1, 2])
    s.finish(first, [choice([7])])
    # the harness truncated its history: the prompt does not hold the previous prompt + choice
    second = s.begin([1, 9, 9], continues=(first, 0))
    assert second.segment == 1 and second.new_tokens == 3 and first.continued_by is None
    s.finish(second, [choice([8])])
    segments = s.close()
    assert [seg.sequence()[0] for seg in segments] == [[1, 2], [1, 9, 9]]
    assert [[t.token_ids for t in seg.sequence()[1]] for seg in segments] == [[[7]], [[8]]]


def test_the_continued_choice_of_n_is_the_one_in_the_sequence():
    s = SessionStore(4).open()
    first = s.begin([1])
    s.finish(first, [choice([5]), choice([6])])
    second = s.begin([1, 6, 2], continues=(first, 1))
    assert second.segment == 0 and first.continued_by == 1
    s.finish(second, [choice([3])])
    [segment] = s.close()
    assert segment.token_ids == [1, 6, 2, 3]


def test_two_calls_racing_on_one_tip_split_into_segments():
    s = SessionStore(4).open()
    first = s.begin([1])
    s.finish(first, [choice([5])])
    a = s.begin([1, 5, 2], continues=(first, 0))
    b = s.begin([1, 5, 3], continues=(first, 0))  # the tip moved on with a: b is a segment of its own
    assert (a.segment, b.segment) == (0, 1) and b.new_tokens == 3
    assert s.tips() == []  # neither finished yet


def test_an_aborted_call_is_in_no_segment_and_cannot_be_continued():
    s = SessionStore(4).open()
    first = s.begin([1])
    s.abort(first, "the client went away")
    assert s.tips() == [] and s.close() == []
    assert s.calls[0].aborted == "the client went away"


def test_the_store_names_unknown_sessions_and_its_limit():
    store = SessionStore(max_sessions=1)
    s = store.open()
    assert s.id.startswith("rls-") and store.get(s.id) is s
    with pytest.raises(SessionLimitError, match="max_sessions = 1"):
        store.open()
    store.close(s.id)
    with pytest.raises(UnknownSessionError, match="no open session"):
        store.get(s.id)
