"""What the trainer publishes, one object per channel:

* :class:`Versions` — weight versions, through the run's transport (``[weights]``);
* :class:`Tickets` — prompt groups out (PROMPTS): training groups from the collector, evaluation rounds
  from :mod:`services.trainer.evaluation`;
* :class:`Outcomes` — what became of each trajectory (OUTCOMES), counted in the ledger;
* :class:`Reporter` — metrics (METRICS, the service's gauges, and ``metrics.jsonl`` in the run directory).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
from nats.errors import MaxPayloadError

from proto import catalog, codec
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.deadletter import DeadLetter
from proto.prompts import PromptTicket, Sampling
from services.lib.weights.transport import VersionNotDelivered, WeightSender
from services.runtime import bus, metrics, tracing
from services.runtime.service import ServiceContext
from services.tasks.base import Prompt
from services.tasks.mixture import Mixture
from services.trainer.admission import Sample
from services.trainer.config import TrainerConfig
from services.trainer.ledger import Ledger

log = logging.getLogger("rlbus.trainer.outbox")
_OUTCOMES = metrics.counter("trajectory_outcomes", "trajectories trained, dropped (by reason) or evaluated")
_UNDELIVERED = metrics.counter("weights_undelivered", "weight versions a keep-nothing transport failed to deliver")


class Versions:
    """Sends the learner's weights as the ledger's current version."""

    def __init__(self, sender: WeightSender, ledger: Ledger) -> None:
        self.sender = sender
        self.ledger = ledger
        #: the last version's tensor bytes as sent (before a transport's delta or compression)
        self.bytes = 0
        #: versions a keep-nothing transport failed to deliver (each replaced by the next)
        self.undelivered = 0

    async def send(self, state_dict: dict[str, Any]) -> float:
        """Send ``state_dict`` as version ``ledger.state.version`` (durable or delivered when this returns);
        the seconds it took. A transport that keeps nothing (broadcast) and could not deliver it after its own
        recovery fails only this version: logged and counted (``weights/undelivered``), and training goes on
        (the next version replaces it)."""
        t0 = time.perf_counter()
        self.bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        try:
            await self.sender.send(state_dict, self.ledger.state.version)
        except VersionNotDelivered as err:
            self.undelivered += 1
            _UNDELIVERED()
            log.warning("version %d was not delivered (%s); training goes on, the next version replaces it",
                        self.ledger.state.version, err)
        return time.perf_counter() - t0


class Tickets:
    """Builds and publishes the prompt tickets of one run (its environments, tokenizer and sampling settings)."""

    def __init__(self, ctx: ServiceContext, cfg: TrainerConfig, tasks: Mixture, tokenizer: Any) -> None:
        self.ctx = ctx
        self.tasks = tasks
        self.tokenizer = tokenizer
        s = cfg.sampling
        #: per environment: the sampling of its training and its evaluation tickets (its budget and stops)
        self.sampling: dict[str, tuple[Sampling, Sampling]] = {}
        for env in tasks.envs:
            train = Sampling(max_new_tokens=s.max_new_tokens or env.task.max_new_tokens, temperature=s.temperature,
                             top_p=s.top_p, stop=list(env.task.stop))
            self.sampling[env.name] = (train, msgspec.structs.replace(train, temperature=cfg.eval.temperature))
        self.group_size = cfg.group_size
        self.eval_samples = cfg.eval.samples
        #: tickets published at once (``[common] publish_window``)
        self.window = ctx.cfg.common.publish_window
        #: one build at a time: the collector builds in a thread, evaluation rounds on the event loop, and a
        #: fast tokenizer used from two threads at once can fail ("Already borrowed")
        self._building = threading.Lock()

    async def publish(self, prompt: Prompt, group_id: str, version: int, *, is_eval: bool = False) -> None:
        """One ticket: ``group_size`` completions of ``prompt`` (``eval.samples`` for an evaluation round), in
        the environment the prompt was drawn from (:meth:`build`, then :meth:`send`)."""
        await self.send(self.build(prompt, group_id, version, is_eval=is_eval))

    def build(self, prompt: Prompt, group_id: str, version: int, *, is_eval: bool = False) -> PromptTicket:
        """The ticket of ``prompt`` (its prompt tokenized: CPU work, which a thread may do); raises
        :class:`TicketTooLarge` when it would exceed ``[common] max_message_bytes``."""
        group_size = self.eval_samples if is_eval else self.group_size
        env = self.tasks.env(prompt.env)
        with self._building:
            prompt_ids = env.task.format_prompt(self.tokenizer, prompt)
        ticket = PromptTicket(
            run_id=self.ctx.run_id, task=env.name, group_id=group_id, prompt_id=prompt.id,
            prompt_ids=prompt_ids, prompt_text=prompt.text,
            group_size=group_size, policy_version=version, sampling=self.sampling[env.name][int(is_eval)],
            metadata=dict(prompt.metadata), is_eval=is_eval)
        # deterministic msg id: a retried publish (or a resumed trainer) is de-duplicated by JetStream
        ticket.msg_id = f"{self.ctx.run_id}-{group_id}"
        size, limit = len(codec.encode(ticket)), self.ctx.cfg.common.max_message_bytes
        if size > limit:
            raise TicketTooLarge(f"prompt {prompt.id!r} makes a {size}-byte ticket, over [common] max_message_bytes "
                                 f"{limit}: shorten or drop the row")
        return ticket

    def build_all(self, admitted: list[tuple[Prompt, str]], version: int) -> list[PromptTicket | TicketTooLarge]:
        """:meth:`build` of each admitted ``(prompt, group id)``, a ticket too large as its exception."""
        out: list[PromptTicket | TicketTooLarge] = []
        for prompt, group_id in admitted:
            try:
                out.append(self.build(prompt, group_id, version))
            except TicketTooLarge as e:
                out.append(e)
        return out

    async def send(self, ticket: PromptTicket) -> None:
        """Publish a built ticket; a trace per prompt group starts here (rollout, sandbox execs, judge and
        trainer are its spans)."""
        with tracing.span("admit group", root=True, group_id=ticket.group_id, eval=ticket.is_eval,
                          version=ticket.policy_version, group_size=ticket.group_size):
            try:
                await self.ctx.publish(catalog.PROMPTS, ticket)
            except MaxPayloadError as e:
                raise TicketTooLarge(f"prompt {ticket.prompt_id!r} makes a {len(codec.encode(ticket))}-byte ticket, "
                                     "over the NATS server's max_payload: shorten or drop the row") from e

    async def dead_letter(self, prompt: Prompt, group_id: str, reason: str) -> None:
        """A prompt whose ticket cannot be published: a dead letter on ``dlq.prompts`` naming it (its text's
        start), so the run goes on without it."""
        head = f"prompt_id={prompt.id}\n{prompt.text[:4096]}".encode(errors="replace")
        letter = DeadLetter(run_id=self.ctx.run_id, service="trainer", original_subject=catalog.PROMPTS.subject(
            self.ctx.run_id), reason=reason, error_type="TicketTooLarge", payload=head,
            msg_id=f"{self.ctx.run_id}-{group_id}-dead")
        try:
            await self.ctx.publish(catalog.DEAD_LETTERS, letter, "prompts")
        except Exception as e:  # the dead-letter path must not stop the run
            log.warning("could not dead-letter prompt %s (%s): %s", prompt.id, reason, e)


class TicketTooLarge(Exception):
    """A prompt's ticket cannot be published (over the message size limit): its prompt is skipped."""


class Outcomes:
    """Decides outcomes (stream OUTCOMES): owed in the ledger first, published under fixed ids, then written off
    (the rule: :mod:`services.trainer.ledger`)."""

    def __init__(self, ctx: ServiceContext, ledger: Ledger) -> None:
        self.ctx = ctx
        self.ledger = ledger

    def records(self, samples: list[Sample], outcome: str, reason: str = "") -> list[TrajectoryOutcome]:
        """One outcome per sample at the ledger's current step and version (``trained``: in batch order)."""
        step, version = self.ledger.state.step, self.ledger.state.version
        return [TrajectoryOutcome(run_id=self.ctx.run_id, trajectory_id=s.key, group_id=s.group_id,
                                  outcome=outcome, reason=reason, step=step, version=version,  # type: ignore[arg-type]
                                  sample_version=s.version, batch_index=i if outcome == "trained" else -1,
                                  msg_id=f"{s.key}-outcome") for i, s in enumerate(samples)]

    async def record(self, samples: list[Sample], outcome: str, reason: str = "", *, save: bool = True) -> None:
        """Decide one outcome per sample: owed (and the state saved, ``save``), then published."""
        if not samples:
            return
        groups = indices(s for s in samples if not s.item.rollout.is_eval)
        self.ledger.owe(self.records(samples, outcome, reason), groups)
        if save:
            await self.ledger.save()
        await self.flush()

    async def flush(self) -> None:
        """Publish every owed batch (one message each, parts when over the size limit, ids fixed by the batch:
        a batch published again after a crash or a timed-out publish is stored once), the batches in a window
        (``[common] publish_window``); each batch that fails stays owed (retried by the next flush)."""
        owed = [b for b in self.ledger.state.owed if b]
        for batch in [b for b in self.ledger.state.owed if not b]:
            self.ledger.written(batch)
        sent = await bus.in_window((self.ctx.publish_parts(catalog.OUTCOMES, batch, lambda part: OutcomeBatch(
            run_id=self.ctx.run_id, outcomes=part, msg_id=f"{part[0].msg_id}-{len(part)}")) for batch in owed),
            self.ctx.cfg.common.publish_window)
        for batch, result in zip(owed, sent, strict=True):
            o = batch[0]
            if isinstance(result, Exception):  # accounting must not stop training: owed in the saved state, retried
                log.warning("could not record the outcomes of %d trajectories (%s), retried later: %s", len(batch),
                            o.outcome, result)
                continue
            if isinstance(result, BaseException):
                raise result
            # the reason's kind (its text before the first colon) keeps the label set small
            _OUTCOMES(len(batch), outcome=o.outcome, reason=o.reason.split(":", 1)[0][:40] if o.reason else "")
            self.ledger.written(batch)


def indices(samples: Iterable[Sample]) -> dict[str, list[int]]:
    """Group id -> the sample indices of ``samples``."""
    out: dict[str, list[int]] = {}
    for s in samples:
        out.setdefault(s.group_id, []).append(s.sample_index)
    return out


class Reporter:
    """A step's figures: a line of ``metrics.jsonl`` in the run directory, and a report on the bus."""

    def __init__(self, ctx: ServiceContext, run_dir: Path) -> None:
        self.ctx = ctx
        self.path = run_dir / "metrics.jsonl"
        self.started = time.time()

    async def emit(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        rec = {"step": step, "time": now, "elapsed_s": now - self.started, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        await self.ctx.report(values, step=step)
