"""The echo service's configuration (section ``[services.echo]``)."""

from __future__ import annotations

import msgspec


class EchoConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: requests handled at once
    concurrency: int = 8
    #: text prefix added to every reply
    prefix: str = ""
