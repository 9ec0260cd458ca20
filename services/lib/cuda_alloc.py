"""The CUDA caching allocator's setting of rlbus's GPU processes (the trainer, the torch engine).

``expandable_segments:True`` lets a segment grow in place instead of leaving fragmented blocks behind,
which matters where memory is handed back and forth (a colocated trainer and engine) and with variable
sequence lengths. The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA initialises, so it is set
before the first CUDA call of the process; a value already in the environment is the operator's and is
kept. vLLM's sleep mode cannot run with it: the vLLM engine takes it out of its own processes' environment
(``services/lib/engine/vllm_procs.py``).
"""

from __future__ import annotations

import os

#: the allocator setting of GPU processes
CUDA_ALLOC_CONF = "expandable_segments:True"


def set_alloc_conf(value: str = CUDA_ALLOC_CONF) -> str:
    """Put ``value`` in ``PYTORCH_CUDA_ALLOC_CONF`` unless the environment has one; return what is in effect."""
    if value and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
