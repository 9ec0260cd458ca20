"""Sessions of the endpoint: what a black-box agent's calls generated, token for token, as trainable sequences.

An agent harness talks to the endpoint (``services/rollout/endpoint.py``) with its session's id as the API
key. Every call is recorded here with the token ids the engine was given (the prompt as the chat template
rendered it) and, per choice, every generated token with its behaviour logprob and weight version. Nothing
is ever re-tokenised: the endpoint builds the next call's prompt from the previous call's ids.

**One sequence or segments.** When a call continues the previous one (its messages are the previous
messages, the assistant message the endpoint returned, and new messages after them: the usual agent loop),
its prompt is the previous prompt + the chosen choice's generated ids + the new messages' tokens, and the
session's current *segment* grows by the choice (generated) and the new tokens (not generated). When the
harness rewrote or truncated its history, sent a choice the endpoint did not return, branched from an older
call, or raced two calls on one tip, the call starts a new segment holding its whole prompt (not generated).

**What the trainer gets** (:meth:`Segment.sequence`): per segment, the prompt (its leading tokens no call
generated) and turns in the rollout's own shape (``proto.rollouts.Turn``): ``assistant`` turns are generated
tokens with their logprobs and versions (trained), ``tool`` turns are everything else the model was
conditioned on (tool results, user turns, template framing: masked out of the loss). Each segment is one
sequence with its own prompt and mask, exactly like one rollout; the first is the sample's prompt and turns,
the others its ``extra_segments``, all trained with the episode's reward and advantage; the staleness filter
reads the oldest token version over every segment (``Rollout.min_version``). Choices of ``n > 1`` that the next call did not
continue, and calls cut off (a client gone mid-generation), are recorded in :attr:`Session.calls` but are in
no segment.

Pure bookkeeping: no HTTP, no tokenizer, no engine.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from proto.rollouts import Turn


class SessionError(Exception):
    """A session cannot be used as asked."""


class UnknownSessionError(SessionError, KeyError):
    """No open session has this id (never opened, or already closed)."""

    def __str__(self) -> str:
        return str(self.args[0])


class SessionBudgetError(SessionError):
    """A call past the session's budget of calls or tokens; ``reason`` is the finish reason it ends the episode
    with (``turn_limit`` or ``token_budget``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SessionLimitError(SessionError):
    """Opening another session would pass ``max_sessions``."""


@dataclass
class Choice:
    """One generated completion of a call."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    #: what a continuing call must send back for this choice (the endpoint's normalised assistant message)
    key: Hashable = None


@dataclass
class Call:
    """One request: the prompt ids the engine was given and what it generated."""

    index: int
    #: the segment this call's prompt belongs to
    segment: int
    prompt_ids: list[int]
    #: prompt tokens new to the sequence (prefilled beyond what the segment already held)
    new_tokens: int
    #: what a continuing call's history must start with (the endpoint's normalised messages or prompt)
    context: Hashable = None
    choices: list[Choice] = field(default_factory=list)
    #: the choice the next call continued (None: none did)
    continued_by: int | None = None
    #: why the call produced nothing (the client went away, the engine refused); None when it finished
    aborted: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None


@dataclass
class Segment:
    """One sequence: token ids, and per token whether the policy generated it (with logprob and version)."""

    token_ids: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: the call whose prompt is the segment's tip (its choices not yet in the segment)
    tip: int = -1

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None) -> None:
        """Append ``ids``: generated when ``logprobs`` and ``versions`` are given, else context."""
        gen = logprobs is not None and versions is not None
        if gen and not (len(ids) == len(logprobs or []) == len(versions or [])):
            raise SessionError("generated tokens need one logprob and one version each")
        self.token_ids += ids
        self.generated += [gen] * len(ids)
        self.logprobs += list(logprobs) if gen else [0.0] * len(ids)
        self.versions += list(versions) if gen else [-1] * len(ids)

    def sequence(self, decode: Callable[[list[int]], str] | None = None) -> tuple[list[int], list[Turn]]:
        """``(prompt_ids, turns)`` as a rollout carries them: the leading context, then alternating runs of
        generated (``assistant``) and context (``tool``) tokens; ``decode`` fills each turn's text."""
        first = next((i for i, g in enumerate(self.generated) if g), len(self.token_ids))
        turns: list[Turn] = []
        i = first
        while i < len(self.token_ids):
            gen = self.generated[i]
            j = i
            while j < len(self.token_ids) and self.generated[j] == gen:
                j += 1
            ids = self.token_ids[i:j]
            text = decode(ids) if decode is not None else ""
            if gen:
                turns.append(Turn(role="assistant", token_ids=ids, logprobs=self.logprobs[i:j],
                                  versions=self.versions[i:j], text=text))
            else:
                turns.append(Turn(role="tool", token_ids=ids, text=text))
            i = j
        return self.token_ids[:first], turns


class Session:
    """One episode's calls and the segments they make."""

    def __init__(self, session_id: str, labels: dict[str, str] | None = None, max_calls: int | None = None,
                 max_tokens: int | None = None) -> None:
        self.id = session_id
        self.labels = dict(labels or {})
        #: budgets (None: none): model calls, and tokens generated + prompt tokens added after the first call
        self.max_calls = max_calls
        self.max_tokens = max_tokens
        #: the budget a call ran into (``turn_limit``/``token_budget``), None while none did
        self.exhausted: str | None = None
        self.calls: list[Call] = []
        self.segments: list[Segment] = []
        self.generated_tokens = 0
        self.prefilled_tokens = 0

    @property
    def used_tokens(self) -> int:
        """Tokens counted against ``max_tokens``: generated, and prompt tokens added after the first call."""
        return self.generated_tokens + self.prefilled_tokens - (len(self.calls[0].prompt_ids) if self.calls else 0)

    def tokens_left(self) -> int | None:
        """What ``max_tokens`` leaves (None: no budget). Raises :class:`SessionBudgetError` when a call would
        pass a budget (and records which, in :attr:`exhausted`)."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.exhausted = self.exhausted or "turn_limit"
            raise SessionBudgetError("turn_limit", f"the session's budget of {self.max_calls} model calls is spent")
        if self.max_tokens is None:
            return None
        left = self.max_tokens - self.used_tokens
        if left <= 0:
            self.exhausted = self.exhausted or "token_budget"
            raise SessionBudgetError("token_budget", f"the session's budget of {self.max_tokens} tokens is spent")
        return left

    def tips(self) -> list[Call]:
        """The calls a new call may continue, newest first: finished, and still the tip of their segment."""
        calls = [self.calls[s.tip] for s in self.segments if s.tip >= 0]
        return sorted((c for c in calls if c.choices and c.aborted is None), key=lambda c: -c.index)

    def begin(self, prompt_ids: list[int], context: Hashable = None,
              continues: tuple[Call, int] | None = None) -> Call:
        """Record a call about to generate from ``prompt_ids``. ``continues = (call, choice)``: the prompt is
        that call's prompt + that choice's ids + new tokens; the segment grows when it is still that call's
        tip (else, as for ``None``, a new segment starts with the whole prompt)."""
        if continues is not None:
            prev, j = continues
            seg = self.segments[prev.segment]
            choice = prev.choices[j]
            head = len(prev.prompt_ids) + len(choice.token_ids)
            if (seg.tip == prev.index and prompt_ids[:len(prev.prompt_ids)] == prev.prompt_ids
                    and prompt_ids[len(prev.prompt_ids):head] == choice.token_ids):
                seg.add(choice.token_ids, choice.logprobs, choice.versions)
                new = prompt_ids[head:]
                seg.add(new)
                prev.continued_by = j
                call = Call(index=len(self.calls), segment=prev.segment, prompt_ids=list(prompt_ids),
                            new_tokens=len(new), context=context)
                seg.tip = call.index
                return self._record(call)
        seg = Segment()
        seg.add(list(prompt_ids))
        self.segments.append(seg)
        call = Call(index=len(self.calls), segment=len(self.segments) - 1, prompt_ids=list(prompt_ids),
                    new_tokens=len(prompt_ids), context=context)
        seg.tip = call.index
        return self._record(call)

    def _record(self, call: Call) -> Call:
        self.calls.append(call)
        self.prefilled_tokens += call.new_tokens
        return call

    def finish(self, call: Call, choices: list[Choice]) -> None:
        """The call's choices (the segment takes the one a continuing call names, or the only one at close)."""
        call.choices = choices
        call.ended_at = time.monotonic()
        self.generated_tokens += sum(len(c.token_ids) for c in choices)

    def abort(self, call: Call, reason: str) -> None:
        """The call ended without a result (``reason``); it cannot be continued."""
        call.aborted = reason
        call.ended_at = time.monotonic()
        if self.segments[call.segment].tip == call.index:
            self.segments[call.segment].tip = -1

    def close(self) -> list[Segment]:
        """The segments, each tip's choice committed (the first choice of a call nobody continued: with n > 1
        pick by continuing; calls with several choices and no continuation keep only choice 0)."""
        for seg in self.segments:
            if seg.tip >= 0:
                call = self.calls[seg.tip]
                if call.choices and call.aborted is None:
                    c = call.choices[0]
                    seg.add(c.token_ids, c.logprobs, c.versions)
                    call.continued_by = 0
                seg.tip = -1
        return [s for s in self.segments if any(s.generated)]


class SessionStore:
    """The open sessions of one endpoint, by id."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._open: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, labels: dict[str, str] | None = None, session_id: str | None = None, *,
             max_calls: int | None = None, max_tokens: int | None = None) -> Session:
        """A new session (its id: ``session_id``, else a random ``rls-...`` string, usable as an API key) with
        budgets of model calls and tokens (None: none)."""
        if len(self._open) >= self.max_sessions:
            raise SessionLimitError(f"{len(self._open)} sessions are open (max_sessions = {self.max_sessions}); "
                                    "close finished ones")
        sid = session_id or f"rls-{secrets.token_urlsafe(18)}"
        if sid in self._open:
            raise SessionError(f"session {sid!r} is already open")
        session = self._open[sid] = Session(sid, labels, max_calls=max_calls, max_tokens=max_tokens)
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self._open[session_id]
        except KeyError:
            raise UnknownSessionError(f"no open session {session_id!r}") from None

    def close(self, session_id: str) -> Session:
        """Remove the session and return it (its :meth:`Session.close` gives the segments)."""
        session = self.get(session_id)
        del self._open[session_id]
        return session
