"""The teacher service's configuration (section ``[services.teacher]``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class TeacherConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A teacher model served on the bus: it scores the student's sampled tokens (on-policy distillation)."""

    #: the teacher model: a builtin (tiny-addition, smollm2), a Hugging Face directory or a Hub id already in the
    #: local cache. Its tokenizer must be the student's (``[model] name``): start-up stops otherwise
    model: str = ""
    #: where builtin models are built and cached (empty: [model] cache_dir, else ~/.cache/rlbus or $RLBUS_CACHE)
    cache_dir: str = ""
    #: the device the teacher runs on (cpu, cuda, cuda:N)
    device: str = "cpu"
    #: the teacher's weights' precision
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: sequences scored in one forward pass
    max_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 32
    #: torch CPU threads of this process (0: torch's default)
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 1
    #: the largest request served, in sequences (a bigger one is answered with an error naming the limit)
    max_sequences: Annotated[int, msgspec.Meta(ge=1)] = 1024
