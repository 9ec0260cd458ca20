"""``rlbus replay step N``: recompute trainer step N of a recorded run and check it against what was recorded.

Everything comes from the run directory: the resolved config (``config.resolved.json``), the run's stored
JetStream (started read-only-in-effect on a free port: nothing is published), its OUTCOMES (which
trajectories step N trained on, in batch order: ``batch_index``), its TRAJECTORIES (tokens, behaviour
logprobs, rewards), the weight version step N started from (one before the version its outcomes name, from the
run's weight store: ``N - 1`` unless a restart moved the numbers on; version 0 is the model the run started
with) and ``metrics.jsonl`` (the loss and gradient norm step N recorded).

The step is recomputed with the trainer's own :class:`~services.trainer.learner.Learner` (one rank on the
CPU, the run's thread count): micro-batches, loss, backward, the gradient norm before clipping; no
optimiser step (the loss and gradient norm do not depend on the optimiser's state). On the CPU with the
run's settings the figures are bit-identical to the recorded ones; anything missing (a version the
weight store's retention removed, a stream the run no longer holds) is said exactly.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ReplayError(Exception):
    """The step cannot be rebuilt; the message says exactly what is missing."""


@dataclass
class Replayed:
    step: int
    samples: int
    recorded: dict[str, float]
    recomputed: dict[str, float]
    #: the weight version the step started from
    start_version: int = -1
    #: what the streams held that did not decode (skipped), as one line; "" when nothing was skipped
    skipped: str = ""

    @property
    def identical(self) -> bool:
        return all(self.recomputed.get(k) == v for k, v in self.recorded.items())

    def report(self) -> str:
        lines = [f"step {self.step}: {self.samples} trajectories, weights of version {self.start_version}"]
        for key, rec in self.recorded.items():
            new = self.recomputed.get(key, math.nan)
            same = "identical" if new == rec else f"differs by {abs(new - rec):.3g}"
            lines.append(f"  {key:<16} recorded {rec!r:<24} recomputed {new!r:<24} {same}")
        if self.skipped:
            lines.append(f"  note: {self.skipped}")
        return "\n".join(lines)


COMPARED = ("losses/total", "losses/policy", "optim/grad_norm")


def _recorded(run_dir: Path, step: int) -> dict[str, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReplayError(f"{path} is missing: not a run directory of rlbus run/up, or the trainer never stepped")
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("step") == step and "optim/grad_norm" in rec:
            return {k: float(rec[k]) for k in COMPARED if k in rec}
    raise ReplayError(f"{path} records no train step {step} (eval rows and other steps only)")


async def _batch_and_weights(run_dir: Path, run_id: str, transport: Any, step: int,
                             skipped: Any = None) -> tuple[list[Any], dict | None, int]:
    from proto import catalog
    from services.launcher.accounting import read_channel
    from services.launcher.connect import with_stored_streams
    from services.lib.weights.transport import store_subscriber
    from services.runtime.weights_config import StoreTransportConfig

    store = run_dir / "nats"
    if not store.is_dir():
        raise ReplayError(f"{store} is missing: the run's JetStream store is not in its run directory")
    async def read(nc: Any, _run: str) -> tuple[list[Any], dict | None, int]:
        js = nc.jetstream()
        outcomes = await read_channel(js, catalog.OUTCOMES, run_id, skipped)
        used = sorted((o for o in outcomes if o.outcome == "trained" and o.step == step),
                      key=lambda o: o.batch_index)
        if not used:
            raise ReplayError(f"no trajectory is recorded as trained at step {step} in the OUTCOMES stream")
        if any(o.batch_index < 0 for o in used):
            raise ReplayError(f"step {step}'s outcomes carry no batch order (recorded by an older rlbus): "
                              "its batch cannot be rebuilt exactly")
        wanted = {o.trajectory_id for o in used}
        trajectories = {t.msg_id: t for t in await read_channel(js, catalog.TRAJECTORIES, run_id, skipped)
                        if t.msg_id in wanted}
        missing = [o.trajectory_id for o in used if o.trajectory_id not in trajectories]
        if missing:
            raise ReplayError(f"{len(missing)} of step {step}'s {len(used)} trajectories are no longer in the "
                              f"TRAJECTORIES stream (retention removed them), e.g. {missing[0]}")
        batch = [trajectories[o.trajectory_id] for o in used]
        start = used[0].version - 1  # each step sends one version: the one it produced, named by its outcomes
        weights = None
        if start > 0:
            if not isinstance(transport, StoreTransportConfig):
                raise ReplayError(f"the run's weight transport is {type(transport).__name__}: it stores no "
                                  f"versions, so the weights of version {start} (step {step} started from) "
                                  "are not on record")
            sub = store_subscriber(transport, nc, run_id)
            await sub.ensure()
            manifest = await sub.index.manifest(start)
            if manifest is None:
                kept = await sub.index.versions()
                raise ReplayError(f"weight version {start}, which step {step} started from (it produced version "
                                  f"{start + 1}), is not in the run's weight store (kept: "
                                  f"{kept[:10]}{' ...' if len(kept) > 10 else ''}): retention removed it")
            weights = await sub.fetch(manifest)
        return batch, weights, start

    return await with_stored_streams(store.parent, run_id, read)


def replay_step(run_dir: str | Path, step: int) -> Replayed:
    """Rebuild and recompute trainer step ``step`` of the run in ``run_dir``."""
    import msgspec
    import torch

    from services.launcher.accounting import Undecodable
    from services.runtime.config import DistillSection, ModelSection
    from services.runtime.weights_config import TransportConfig
    from services.tasks.models import resolve_model
    from services.trainer.config import TrainerConfig
    from services.trainer.devices import Placement, precision_defaults
    from services.trainer.learner import Learner
    from services.trainer.optim import clip_grad_norm
    from services.trainer.step_input import StepInput

    run_dir = Path(run_dir)
    if step < 1:
        raise ReplayError("steps are numbered from 1")
    resolved = run_dir / "config.resolved.json"
    if not resolved.is_file():
        raise ReplayError(f"{resolved} is missing: not a run directory of rlbus run/up")
    tree = json.loads(resolved.read_text())
    try:
        cfg = msgspec.convert(tree.get("services", {}).get("trainer", {}), TrainerConfig, strict=False)
        model = msgspec.convert(tree.get("model", {}), ModelSection, strict=False)
        transport = msgspec.convert(tree.get("weights", {}), TransportConfig, strict=False)  # type: ignore[arg-type]
        distill = msgspec.convert(tree.get("distill", {}), DistillSection, strict=False)
    except msgspec.ValidationError as e:
        raise ReplayError(f"the run's trainer config does not load in this rlbus: {e}") from e
    if cfg.devices.world_size != 1:
        raise ReplayError(f"the run trained with {cfg.devices.world_size} ranks; replay recomputes one-rank "
                          "steps only")
    recorded = _recorded(run_dir, step)
    run_id = tree.get("run", {}).get("id", "default")
    skipped = Undecodable()  # garbage on the streams is skipped (a trained trajectory always decoded)
    batch, weights, start = asyncio.run(_batch_and_weights(run_dir, run_id, transport, step, skipped))
    model_dir = resolve_model(model.name, model.cache_dir or None, seed=int(tree.get("run", {}).get("seed", 0)),
                              revision=model.revision or None)
    # on CPU: "auto" is float32 here (a run that trained on CUDA with "auto" had bf16: name it to replay it)
    learner = Learner(cfg, model_dir, Placement("cpu", "cpu", "gloo",
                                                dtype=precision_defaults("cpu", model.dtype, cfg).dtype))
    if weights is not None:
        learner.load_weights({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    learner.optimizer.zero_grad(set_to_none=True)
    sums, n_mb, passes = learner.accumulate(StepInput.of(batch, cfg, distill))
    recomputed = {k: v for k, v in sums.items() if k.startswith("losses/")}
    if passes:
        with torch.no_grad():
            recomputed["optim/grad_norm"] = clip_grad_norm(learner.model.parameters(), cfg.optim.max_grad_norm)
    return Replayed(step, len(batch), recorded, recomputed, start_version=start, skipped=skipped.note())


# --- dead letters ------------------------------------------------------------------------------------------


@dataclass
class Letter:
    seq: int
    letter: Any  # proto.deadletter.DeadLetter

    def line(self) -> str:
        d = self.letter
        return (f"#{self.seq} {d.original_subject} from {d.service} after {d.deliveries} deliveries: "
                f"{d.error_type}: {d.reason[:200]}")


async def dead_letters(nc: Any, run_id: str, family: str, skipped: Any = None) -> list[Letter]:
    """Every dead letter of ``family`` the run's DLQ stream holds, oldest first. A stored message that is not
    a dead letter (garbage on the DLQ subject) is skipped and counted in ``skipped``
    (:class:`services.launcher.accounting.Undecodable`)."""
    from nats.js import api

    from proto import catalog, codec
    from proto.deadletter import DeadLetter

    js = nc.jetstream()
    subject = catalog.DEAD_LETTERS.subject(run_id, family)
    try:
        info = await js.stream_info(catalog.DLQ_STREAM.name)
    except Exception as e:
        raise ReplayError(f"the run has no {catalog.DLQ_STREAM.name} stream ({e})") from e
    out: list[Letter] = []
    if info.state.messages == 0:
        return out
    sub = await js.pull_subscribe(subject, stream=catalog.DLQ_STREAM.name, config=api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE, inactive_threshold=60.0))
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except Exception:  # nats' TimeoutError: nothing more
                break
            for m in msgs:
                try:
                    letter = codec.decode(m.data, DeadLetter, max_bytes=None)
                except codec.DecodeError as e:
                    if skipped is not None:
                        skipped.add(catalog.DLQ_STREAM.name, m.metadata.sequence.stream, e)
                    continue
                out.append(Letter(m.metadata.sequence.stream, letter))
            if len(msgs) < 256:
                break
    finally:
        await sub.unsubscribe()
    return out


def fix_payload(subject: str, payload: bytes, fixes: list[str]) -> bytes:
    """The payload with each ``PATH=VALUE`` of ``fixes`` applied (``PATH``: dotted field names, list indices as
    numbers, e.g. ``ticket.metadata.answer`` or ``rollouts.0.turns.0.text`` of a rollout group; ``VALUE``: a
    JSON literal, else the text as a string). An older bare record is fixed as it was stored (its own fields).

    Raises ReplayError naming the fix when a path does not exist or the fixed message no longer decodes as
    its channel's type: nothing malformed is sent again."""
    import json

    import msgspec

    from proto import codec, registry

    try:
        msg = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ReplayError(f"the dead letter's payload is not msgpack ({e}): it cannot be fixed field by field") from e
    for fix in fixes:
        path, sep, text = fix.partition("=")
        if not sep or not path:
            raise ReplayError(f"--fix {fix!r}: expected PATH=VALUE, e.g. ticket.metadata.answer=\"5\"")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *parents, last = path.split(".")
        node = msg
        try:
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if isinstance(node, list):
                node[int(last)] = value
            elif isinstance(node, dict) and last in node:
                node[last] = value
            else:
                raise KeyError(last)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ReplayError(f"--fix {fix!r}: the message has no field {path!r} ({type(e).__name__}: {e})") from e
    fixed = msgspec.msgpack.encode(msg)
    typ = registry.type_for_subject(subject)
    if typ is not None:
        try:
            codec.decode(fixed, typ, max_bytes=None)
        except codec.DecodeError as e:
            raise ReplayError(f"the fixed message would be refused, so nothing was sent: {e}") from e
    return fixed


async def republish(nc: Any, letters: list[Letter], *, attempt: str, fixes: list[str] | None = None) -> int:
    """Publish each letter's original payload (with ``fixes`` applied, see :func:`fix_payload`; all are checked
    before any is sent) to its original subject, with its original headers but a new message id
    (``<id>-replay-<attempt>``: JetStream's de-duplication would drop the original id)."""
    js = nc.jetstream()
    if fixes:
        for item in letters:
            fix_payload(item.letter.original_subject, item.letter.payload, fixes)
    done = 0
    for item in letters:
        d = item.letter
        headers = {k: v for k, v in d.headers.items() if not k.lower().startswith("nats-")}
        original = d.headers.get("Nats-Msg-Id", f"dlq-{item.seq}")
        headers["Nats-Msg-Id"] = f"{original}-replay-{attempt}"
        payload = fix_payload(d.original_subject, d.payload, fixes) if fixes else d.payload
        await js.publish(d.original_subject, payload, headers=headers)
        done += 1
    return done
