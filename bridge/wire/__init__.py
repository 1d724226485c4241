"""The bridge's wire layer (torch, never jax): the sync session and what it drives.

``session`` (``SyncSession``: one sync of one rank: handshake, votes, buckets, final ack),
``handshake`` (the header, ``Role``, ``HandshakeStatus``), ``transport`` (the ``Transport``
protocol that moves the payload), ``gloo`` (``GlooTransport``), ``bucket`` (``Side``, the
staging ``Arena``), ``tally`` (counts turned into ``ExecutionStats``), ``alarm`` (a failing
rank tells every rank at once), ``vote`` (per-bucket votes: sizes, checksums, failures),
``digest`` (piece digests), ``group`` (``init_group``, ``rebuild_group``), ``commit``
(``Receiver``'s commit strategies), ``receiver`` (``Receiver``: the inference side).
"""
