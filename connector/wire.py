"""The side-channel protocol between a decoder worker and a prefiller worker.

The decoder sends one :class:`PullRequest` per prefiller per engine step (many
requests share it, up to :data:`MAX_ITEMS` per message); the prefiller answers each
item with its own :class:`PullReply` as soon as that item's blocks are pushed, so a
slow request never holds up others. An item with no block ids is a release: the
decoder needs nothing (prefix hit, or the request was aborted) and the prefiller frees
its blocks at once. Every item carries the per-request secret the prefiller issued in
its ``kv_transfer_params``: only the holder of that answer (the proxy, then the
decoder) can pull or release that request.

Every field is bounded (lengths, counts, ranges) so a hostile peer cannot make the
prefiller allocate or loop without limit; the socket also caps the frame size.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PROTOCOL_VERSION = 4

# Hard caps enforced while decoding (a message over any of them is refused whole).
MAX_ITEMS = 1024  # requests per pull message
MAX_GROUPS = 64  # KV cache groups
MAX_BLOCKS = 1 << 20  # block slots per group and request
MAX_REGIONS = 1 << 16  # KV regions per group
MAX_ID_LEN = 256  # transfer ids, secrets, engine ids, sessions
MAX_ERROR_LEN = 1024
MAX_TP = 1024  # tensor-parallel ranks

# A reply error starting with this says the prefiller's transfer engine failed to write to
# the decoder (or a push before it did): bytes may still land later (see receiver.py).
ENGINE_FAILED = "decoder unreachable"

Address = Annotated[int, msgspec.Meta(ge=0)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
Ident = Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
BlockSlots = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS)]
GroupSlots = Annotated[list[BlockSlots], msgspec.Meta(max_length=MAX_GROUPS)]


class PullItem(msgspec.Struct, frozen=True):
    transfer_id: Ident
    secret: Ident
    # Per KV cache group, the decoder's block slots to fill (positional, 0 = skip).
    # All lists empty: a release.
    block_ids: GroupSlots

    @property
    def is_release(self) -> bool:
        return not any(self.block_ids)


class GroupGeometry(msgspec.Struct, frozen=True):
    """The decoder's memory for one KV cache group (see layout.GroupLayout)."""

    kind: Annotated[str, msgspec.Meta(max_length=64)]
    block_size: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
    region_bases: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_REGIONS)
    ]
    block_len: Annotated[int, msgspec.Meta(gt=0, lt=1 << 40)]
    block_stride: Annotated[int, msgspec.Meta(gt=0, lt=1 << 40)]
    num_blocks: Annotated[int, msgspec.Meta(gt=0, lt=1 << 40)]
    # Bytes of one KV head in a block when heads are outermost there, else 0 (then only a
    # prefiller of the same TP size can fill these blocks).
    head_bytes: Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)] = 0


class Compat(msgspec.Struct, frozen=True):
    """What must match for a prefiller's KV bytes to mean the same thing on a decoder.

    Byte geometry alone is not enough: two dtypes (or two models) of equal size would pass
    the layout check and decode garbage.
    """

    protocol: int
    model: Annotated[str, msgspec.Meta(max_length=MAX_ID_LEN)]
    dtype: Annotated[str, msgspec.Meta(max_length=64)]
    kv_cache_dtype: Annotated[str, msgspec.Meta(max_length=64)]
    num_layers: int
    # The model's KV heads over all TP ranks: the two sides may split them differently.
    total_kv_heads: int
    head_size: int

    def mismatch(self, other: Compat | None) -> str:
        """Empty if compatible, else which fields differ (ours vs theirs)."""
        if other is None:
            return "the decoder sent no compatibility fingerprint"
        diffs = [
            f"{name} {getattr(self, name)!r} here vs {getattr(other, name)!r} on the decoder"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return ("incompatible decoder: " + "; ".join(diffs)) if diffs else ""


class PullRequest(msgspec.Struct, frozen=True, tag="pull"):
    version: int
    msg_id: Annotated[int, msgspec.Meta(ge=0)]
    decoder_engine_id: Ident
    # "host:rpc_port" of the decoder's transfer engine: where the prefiller writes.
    decoder_session: Ident
    groups: Annotated[list[GroupGeometry], msgspec.Meta(max_length=MAX_GROUPS)]
    # Unix time (ms, decoder's clock) after which the decoder has given up: the prefiller
    # refuses the pull and starts no push batch after it (the blocks may be reused by then).
    deadline_ms: int
    items: Annotated[list[PullItem], msgspec.Meta(max_length=MAX_ITEMS)]
    # None only in a release-only message (a router freeing blocks): it writes nothing.
    compat: Compat | None = None
    # Ask for a keyed digest of the pushed bytes in each reply (the decoder's opt-in check).
    want_digest: bool = False
    # The decoder worker's TP size and rank: with the prefiller's own, they decide which
    # KV heads this pull copies and how many pulls each held request gets (connector.tp).
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)] = 1
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP)] = 0


class PullReply(msgspec.Struct, frozen=True, tag="reply"):
    msg_id: int
    # Empty when the whole message was unreadable.
    transfer_id: Ident
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_LEN)] = ""
    num_bytes: int = 0
    num_segments: int = 0
    # Per group, the decoder slots that were written, in pairing order: the decoder checks
    # them against what it asked for and what the byte count implies.
    written: GroupSlots = msgspec.field(default_factory=list)
    # Keyed BLAKE3 of the pushed bytes (empty unless the pull asked for it).
    digest: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


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
        raise WireError(f"malformed side-channel message: {str(exc)[:200]}") from exc


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
