"""The side-channel protocol between a decoder worker and a prefiller worker.

The decoder sends one :class:`PullRequest` per prefiller per engine step (many
requests share it); the prefiller answers each item with its own :class:`PullReply`
as soon as that item's blocks are pushed, so a slow request never holds up others.
An item with no block ids is a release: the decoder needs nothing (prefix hit, or
the request was aborted) and the prefiller frees its blocks at once. Every item carries
the per-request secret the prefiller issued in its ``kv_transfer_params``: only the
holder of that answer (the proxy, then the decoder) can pull or release that request.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 2


class PullItem(msgspec.Struct, frozen=True):
    transfer_id: str
    secret: str
    # Per KV cache group, the decoder's block slots to fill (positional, 0 = skip).
    # All lists empty: a release.
    block_ids: list[list[int]]

    @property
    def is_release(self) -> bool:
        return not any(self.block_ids)


class GroupGeometry(msgspec.Struct, frozen=True):
    """The decoder's memory for one KV cache group (see layout.GroupLayout)."""

    kind: str
    block_size: int
    region_bases: list[int]
    block_len: int
    block_stride: int
    num_blocks: int


class PullRequest(msgspec.Struct, frozen=True, tag="pull"):
    version: int
    msg_id: int
    decoder_engine_id: str
    # "host:rpc_port" of the decoder's transfer engine: where the prefiller writes.
    decoder_session: str
    groups: list[GroupGeometry]
    # Unix time (ms, decoder's clock) after which the decoder has given up: the prefiller
    # refuses the pull and starts no push batch after it (the blocks may be reused by then).
    deadline_ms: int
    items: list[PullItem]


class PullReply(msgspec.Struct, frozen=True, tag="reply"):
    msg_id: int
    # Empty when the whole message was unreadable.
    transfer_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    num_segments: int = 0


Message = PullRequest | PullReply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class WireError(ValueError):
    """A side-channel message could not be decoded or failed validation."""


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed side-channel message: {exc}") from exc


def decode_pull(data: bytes) -> PullRequest:
    msg = decode(data)
    if not isinstance(msg, PullRequest):
        raise WireError(f"expected a pull request, got {type(msg).__name__}")
    if msg.version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {msg.version} not supported (want {PROTOCOL_VERSION})")
    return msg


def decode_reply(data: bytes) -> PullReply:
    msg = decode(data)
    if not isinstance(msg, PullReply):
        raise WireError(f"expected a pull reply, got {type(msg).__name__}")
    return msg
