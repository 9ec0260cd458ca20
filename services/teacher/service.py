"""The teacher service: serves a teacher model's logprobs of the student's sampled tokens (on-policy
distillation, :mod:`services.trainer.distill`).

Channel ``TEACHER_REQUESTS`` (``rlbus.<run>.teacher.logprobs``, core NATS request/reply, queue group
``teacher``): a :class:`~proto.teacher.TeacherRequest` names sequences (prompt ids, completion ids); the reply
holds the teacher's logprob of every completion token, or an error saying why none were scored. Any number of
workers share the queue group; a request goes to one of them.

At start-up the teacher's tokenizer is checked against the student's (``[model]``): the student's token ids
are scored as they are, so a teacher with another vocabulary stops start-up naming ``services.teacher.model``
and ``model.name``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.msg import Msg

from proto import catalog, codec
from proto.teacher import QUEUE_GROUP, TeacherReply, TeacherRequest
from services.runtime.config import ConfigError, Loaded
from services.runtime.service import ServiceContext
from services.teacher.config import TeacherConfig

log = logging.getLogger("rlbus.teacher")


class TeacherService:
    """``build(loaded)`` checks the config (cheap); ``run(ctx)`` loads the teacher and serves requests."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.cfg: TeacherConfig = loaded.service
        if not self.cfg.model:
            raise ConfigError("config key services.teacher.model: name the teacher model (a builtin, a Hugging Face "
                              "directory or a cached Hub id)")
        self.scorer: Any = None
        self.counters = {"requests": 0, "sequences": 0, "errors": 0}

    def load(self) -> None:
        """Load the teacher and check its tokenizer against the student's (blocking)."""
        import torch

        from services.runtime.loading import HF_LOAD_LOCK
        from services.tasks.models import resolve_model
        from services.teacher.scorer import TeacherScorer, check_same_tokenizer

        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        model, seed = self.loaded.model, self.loaded.run.seed
        teacher_dir = resolve_model(self.cfg.model, self.cfg.cache_dir or model.cache_dir or None, seed=seed)
        student_dir = resolve_model(model.name, model.cache_dir or None, seed=seed, revision=model.revision or None)
        with HF_LOAD_LOCK:
            from transformers import AutoTokenizer

            student_tokenizer = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
            teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_dir, local_files_only=True)
        check_same_tokenizer(teacher_tokenizer, student_tokenizer, "services.teacher.model", "model.name")
        self.scorer = TeacherScorer(teacher_dir, device=self.cfg.device, dtype=self.cfg.dtype,
                                    max_batch_size=self.cfg.max_batch_size)

    async def run(self, ctx: ServiceContext) -> None:
        await asyncio.to_thread(self.load)

        async def on_request(msg: Msg) -> None:
            await self.handle(ctx, msg)

        sub = await ctx.nc.subscribe(catalog.TEACHER_REQUESTS.subject(ctx.run_id), queue=QUEUE_GROUP, cb=on_request)
        await ctx.nc.flush()
        log.info("teacher %s serving run %s", self.scorer.identity, ctx.run_id)
        try:
            await ctx.stop.wait()
        finally:
            await sub.drain()  # requests already received are answered

    async def handle(self, ctx: ServiceContext, msg: Msg) -> None:
        """Answer one request (every failure is an error reply: the requester decides, nothing is retried)."""
        reply = await self.answer(ctx.run_id, msg.data)
        self.counters["requests"] += 1
        self.counters["sequences"] += len(reply.logprobs)
        self.counters["errors"] += bool(reply.error)
        ctx.gauges.update({f"teacher/{k}": float(v) for k, v in self.counters.items()})
        if not msg.reply:
            return  # nobody is waiting
        data = codec.encode(reply)
        if len(data) > ctx.nc.max_payload:
            data = codec.encode(TeacherReply(run_id=ctx.run_id, teacher=self.scorer.identity, error=(
                f"the reply of {len(data)} bytes exceeds the NATS server's max_payload ({ctx.nc.max_payload} "
                "bytes): send fewer sequences per request")))
        await ctx.nc.publish(msg.reply, data)

    async def answer(self, run_id: str, data: bytes) -> TeacherReply:
        """The reply to a request's bytes."""
        def error(text: str) -> TeacherReply:
            log.warning("teacher request refused: %s", text)
            return TeacherReply(run_id=run_id, teacher=self.scorer.identity, error=text)

        try:
            req = codec.decode(data, TeacherRequest, max_bytes=self.loaded.common.max_message_bytes)
        except codec.DecodeError as e:
            return error(f"undecodable request: {e}")
        if req.run_id != run_id:
            return error(f"request of run {req.run_id!r}, this teacher serves {run_id!r}")
        if len(req.sequences) > self.cfg.max_sequences:
            return error(f"{len(req.sequences)} sequences, over services.teacher.max_sequences "
                         f"{self.cfg.max_sequences}")
        try:
            logprobs = await asyncio.to_thread(self.scorer.score, req.sequences, req.temperature)
        except ValueError as e:  # a bad request (empty prompt, an id outside the vocabulary)
            return error(str(e))
        except Exception as e:  # the model failed (out of memory, ...): said, and the service goes on
            log.exception("the teacher failed on a request of %d sequences", len(req.sequences))
            return error(f"the teacher failed: {type(e).__name__}: {e}")
        return TeacherReply(run_id=run_id, logprobs=logprobs, teacher=self.scorer.identity)


def build(loaded: Loaded) -> TeacherService:
    return TeacherService(loaded)
