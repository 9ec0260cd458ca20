"""Entry point of the sandbox service (``rlbus service sandbox``): config is parsed first, the backend loads in ``run``.

The launcher registry maps ``sandbox`` to :class:`services.sandbox.config.SandboxConfig` (section
``[services.sandbox]``) and :func:`build`.
"""

from __future__ import annotations

from services.runtime.config import Loaded
from services.sandbox.service import SandboxService


def build(loaded: Loaded) -> SandboxService:
    """The service for a resolved config (``loaded.service`` is the SandboxConfig)."""
    return SandboxService.from_loaded(loaded)
