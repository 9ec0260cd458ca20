"""The echo workload: a trivial service used by the foundation tests and demos.

Subject ``rlbus.<run>.echo.in`` — published by anyone, consumed by echo workers
(stream ECHO, durable ``echo`` consumer). Subject ``rlbus.<run>.echo.out`` —
published by echo workers with the reply.
"""

from __future__ import annotations

from proto.envelope import Envelope

FAMILY = "echo"


class EchoRequest(Envelope, kw_only=True, tag="echo_request"):
    text: str
    #: seconds the handler works before replying (used by drain tests)
    work_s: float = 0.0
    #: fail this many deliveries with a retryable error before succeeding
    fail_times: int = 0


class EchoReply(Envelope, kw_only=True, tag="echo_reply"):
    text: str
    worker: str
    deliveries: int
