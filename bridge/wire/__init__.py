"""The bridge's wire layer (torch, never jax): the sync session and what it drives.

``session`` (one sync: handshake, votes, buckets, final ack), ``alarm`` (a failing rank tells every
rank at once), ``vote`` (per-bucket votes: sizes, checksums, failures), ``digest`` (piece digests),
``receiver`` (``Receiver``: the inference side).
"""
