"""What one replica publishes to its peers on every exchange, and its wire form (msgpack via msgspec)."""

from __future__ import annotations

import msgspec

from modeldock.flowcontrol.queue_share import QueuedFlow
from modeldock.flowcontrol.standing_share import ModelStanding
from modeldock.picking.peers import Holding
from modeldock.picking.relay import PeerPage

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024  # a peer's share larger than this is refused, not decoded


class ReplicaShare(msgspec.Struct, frozen=True):
    """One replica's state for its peers: its requests in flight per endpoint and its standing per model.

    Keyed by field name (not array-like) so that a replica of the next version, with a field more,
    is still read during a rolling upgrade (unknown fields are ignored)."""

    holdings: tuple[Holding, ...] = ()
    standing: tuple[ModelStanding, ...] = ()  # its tenants' and classes' standing (flowcontrol/standing.py)
    queued: tuple[QueuedFlow, ...] = ()  # what waits in its queues (flowcontrol/queue_share.py)
    pages: tuple[PeerPage, ...] = ()  # its latest own read of each endpoint (picking/relay.py)
    # Which share is newer: the exchange's reply and a push travel on two connections, so a peer's
    # share may arrive twice, out of order. `epoch` is random per process (a restart under the same
    # name starts over), `seq` counts up. 0: a replica that does not number its shares (always taken).
    epoch: int = 0
    seq: int = 0

    def newer_than(self, other: ReplicaShare) -> bool:
        return self.seq == 0 or self.epoch != other.epoch or self.seq > other.seq


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ReplicaShare)


def encode(share: ReplicaShare) -> bytes:
    return _encoder.encode(share)


def decode(payload: bytes) -> ReplicaShare:
    """The share, validated; raises msgspec.ValidationError / DecodeError on anything else."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise msgspec.DecodeError(f"share of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    return _decoder.decode(payload)
