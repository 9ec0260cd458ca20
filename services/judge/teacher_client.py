"""The judge's side of on-policy distillation: asking the teacher service for a group's teacher logprobs.

One request per scored group (its samples that did not fail), on ``TEACHER_REQUESTS``. A teacher that does not
answer (none running, busy past ``distill.request_timeout_s``) or answers with an error is asked again, with a
growing pause, until ``distill.wait_s`` has passed since the first try; then :class:`TeacherUnavailable` says
why, and the judge publishes the samples failed with that reason (the trainer drops them: a sample is never
trained without its teacher logprobs).
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from nats.aio.client import Client

from proto import catalog, codec
from proto.rollouts import Rollout
from proto.teacher import TeacherReply, TeacherRequest, TeacherSequence
from services.runtime.config import DistillSection

log = logging.getLogger("rlbus.judge.teacher")

#: the first pause between tries, doubled each time up to MAX_PAUSE_S
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 5.0


class TeacherUnavailable(Exception):
    """No usable teacher reply within ``distill.wait_s`` (the message says what the last try got)."""


def sequence_of(rollout: Rollout) -> TeacherSequence:
    """What the teacher scores of a rollout: its prompt, and every token of its turns in order (the tokens the
    trainer's loss runs over; observation tokens are scored too, and masked out there)."""
    return TeacherSequence(prompt_ids=list(rollout.prompt_ids),
                           completion_ids=[t for turn in rollout.turns for t in turn.token_ids])


async def teacher_logprobs(nc: Client, run_id: str, rollouts: list[Rollout], cfg: DistillSection,
                           stop: asyncio.Event | None = None) -> list[list[float]]:
    """The teacher's logprobs of each rollout's tokens (one list per rollout, as long as its tokens).

    Raises:
        TeacherUnavailable: no teacher answered usably within ``cfg.wait_s`` (or ``stop`` was set).
    """
    if not rollouts:
        return []
    sequences = [sequence_of(r) for r in rollouts]
    request = codec.encode(TeacherRequest(run_id=run_id, sequences=sequences))
    subject = catalog.TEACHER_REQUESTS.subject(run_id)
    deadline = time.monotonic() + cfg.wait_s
    pause, tries = FIRST_PAUSE_S, 0
    while True:
        tries += 1
        left = deadline - time.monotonic()
        why = await _ask(nc, subject, request, min(cfg.request_timeout_s, max(left, 0.05)), sequences)
        if isinstance(why, list):
            return why
        left = deadline - time.monotonic()
        if left <= 0 or (stop is not None and stop.is_set()):
            raise TeacherUnavailable(f"no teacher logprobs after {cfg.wait_s:g}s ({tries} tries; distill.wait_s): "
                                     f"{why}")
        log.debug("teacher not usable (%s); asking again in %.1fs", why, pause)
        await asyncio.sleep(min(pause, left))  # back-off between tries of a request/reply, not synchronisation
        pause = min(2 * pause, MAX_PAUSE_S)


async def _ask(nc: Client, subject: str, request: bytes, timeout: float,
               sequences: list[TeacherSequence]) -> list[list[float]] | str:
    """One try: the logprobs, or why not."""
    try:
        msg = await nc.request(subject, request, timeout=timeout)
    except nats.errors.NoRespondersError:
        return "no teacher service is running (no responder on the teacher subject)"
    except nats.errors.TimeoutError:
        return f"the teacher did not answer within {timeout:.1f}s (distill.request_timeout_s)"
    try:
        reply = codec.decode(msg.data, TeacherReply, max_bytes=None)
    except codec.DecodeError as e:
        return f"undecodable teacher reply: {e}"
    if reply.error:
        return f"the teacher refused: {reply.error}"
    lengths = [len(s.completion_ids) for s in sequences]
    if [len(row) for row in reply.logprobs] != lengths:
        return f"the teacher answered {[len(r) for r in reply.logprobs]} logprobs for sequences of {lengths} tokens"
    return reply.logprobs
