"""rlbus wire contracts.

Depends on msgspec only. One module per subject family; every message is a
``kw_only`` msgspec Struct deriving from :class:`proto.envelope.Envelope`.
Encoding on the wire is msgpack (:func:`proto.codec.encode` / :func:`proto.codec.decode`).
"""
