"""One process-wide lock around Hugging Face model loading.

Colocated services (``rlbus service trainer+rollout``) load their models in
worker threads of one process. transformers is not thread-safe there: its lazy
module imports race (``cannot import name 'AutoModelForCausalLM'``) and
``from_pretrained`` switches a process-global default device to ``meta`` while
it builds a model, which a concurrent load in another thread then inherits
(``Cannot copy out of meta tensor``). Every import of transformers' model
classes and every ``from_pretrained`` in rlbus runs under this lock.
"""

from __future__ import annotations

import threading

HF_LOAD_LOCK = threading.RLock()
