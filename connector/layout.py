"""Describe vLLM's KV cache tensors as transfer regions, for any device and layout.

vLLM hands the connector one tensor per layer. Their layouts differ by backend (CPU:
``[num_blocks, kv_heads, block_size, 2*head]``; CUDA flash-attention:
``[2, num_blocks, ...]``) and layers may share one allocation, so regions are found
from shapes and strides rather than assumed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from connector.groups import GroupSpec
from connector.plan import RegionLayout
from connector.wire import GroupGeometry


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group's memory: its kind and the regions of its own layers only."""

    kind: str
    block_size: int
    layout: RegionLayout
    # Bytes of one KV head inside a block when heads are the block's outermost dim (a
    # head slice is then one contiguous range), else None: only equal-TP transfers.
    head_bytes: int | None = None


@dataclass(frozen=True)
class KVMemory:
    groups: tuple[GroupLayout, ...]
    # Disjoint (addr, length) spans covering every region: what the engine registers.
    spans: tuple[tuple[int, int], ...]
    num_layers: int

    @property
    def num_regions(self) -> int:
        return sum(len(g.layout.base_addrs) for g in self.groups)


def _block_dim(t: torch.Tensor, num_blocks: int, name: str) -> int:
    for d, size in enumerate(t.shape):
        if size == num_blocks:
            return d
    raise ValueError(
        f"KV tensor {name} of shape {tuple(t.shape)} has no dim of {num_blocks} blocks"
    )


def _inner_is_contiguous(t: torch.Tensor, d: int) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[d + 1 :]), reversed(t.stride()[d + 1 :]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def head_bytes_of(t: torch.Tensor, d: int, local_heads: int, block_size: int) -> int | None:
    """Bytes per KV head in a block of ``t`` (block dim ``d``) if heads are outermost.

    CPU blocks are ``[heads, block_size, 2*head_size]``: each head's K and V rows are one
    range. CUDA's flash-attention blocks are ``[block_size, heads, head_size]``: a head is
    strided, and a different-TP transfer would cost a segment per token (refused).
    """
    inner = t.shape[d + 1 :]
    block_bytes = math.prod(inner) * t.element_size()
    if local_heads == 1:  # the whole block is one head's (MLA, or one head per rank)
        return block_bytes
    if not inner or inner[0] != local_heads:
        return None
    if local_heads == block_size and len(inner) > 1 and inner[1] == block_size:
        return None  # heads-first and tokens-first look alike: do not guess
    return block_bytes // local_heads


def describe_regions(
    kv_caches: Mapping[str, torch.Tensor], layer_names: tuple[str, ...], num_blocks: int
) -> RegionLayout:
    """Regions of these layers in layer order, deduplicated by base address."""
    bases: list[int] = []
    seen: set[int] = set()
    block_len = block_stride = -1
    for name in layer_names:
        t = kv_caches[name]
        d = _block_dim(t, num_blocks, name)
        if not _inner_is_contiguous(t, d):
            raise ValueError(f"KV tensor {name}: a block is not contiguous (strides {t.stride()})")
        el = t.element_size()
        this_len = math.prod(t.shape[d + 1 :]) * el
        this_stride = t.stride(d) * el
        if block_len < 0:
            block_len, block_stride = this_len, this_stride
        elif (this_len, this_stride) != (block_len, block_stride):
            raise ValueError(
                f"KV tensor {name}: block of {this_len} B every {this_stride} B differs from "
                f"the first layer's {block_len} B every {block_stride} B"
            )
        outer_shape = t.shape[:d]
        outer_strides = t.stride()[:d]
        for flat in range(math.prod(outer_shape)):
            offset, rem = 0, flat
            for size, stride in zip(reversed(outer_shape), reversed(outer_strides), strict=True):
                offset += (rem % size) * stride
                rem //= size
            base = t.data_ptr() + offset * el
            if base not in seen:
                seen.add(base)
                bases.append(base)
    return RegionLayout(tuple(bases), block_len, block_stride, num_blocks)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    groups: tuple[GroupSpec, ...] | None = None,
    local_heads: int | None = None,
) -> KVMemory:
    """Per-group regions, and the union of all regions to register once.

    Layers of different groups may share one allocation (vLLM's CPU backend does this),
    so each group's plan uses only its own layers' addresses, while registration covers
    every distinct byte range exactly once. Without ``groups``, all layers form one group.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    if groups is None:
        groups = (GroupSpec("full", 0, tuple(kv_caches)),)
    missing = [n for g in groups for n in g.layer_names if n not in kv_caches]
    if missing:
        raise ValueError(f"KV cache groups name layers with no KV tensor: {missing[:4]}")
    out = []
    spans: list[tuple[int, int]] = []
    for g in groups:
        layout = describe_regions(kv_caches, g.layer_names, num_blocks)
        head_bytes = None
        if local_heads is not None:
            first = kv_caches[g.layer_names[0]]
            d = _block_dim(first, num_blocks, g.layer_names[0])
            head_bytes = head_bytes_of(first, d, local_heads, g.block_size)
        out.append(GroupLayout(g.kind, g.block_size, layout, head_bytes))
        region_bytes = (num_blocks - 1) * layout.block_stride + layout.block_len
        spans += [(b, region_bytes) for b in layout.base_addrs]
    return KVMemory(tuple(out), merge_spans(spans), len(kv_caches))


def merge_spans(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Union of (addr, length) intervals: the engine refuses overlapping registrations."""
    out: list[list[int]] = []
    for addr, length in sorted(spans):
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + length - out[-1][0])
        else:
            out.append([addr, length])
    return tuple((a, n) for a, n in out)


def geometry(group: GroupLayout) -> GroupGeometry:
    lay = group.layout
    return GroupGeometry(
        group.kind,
        group.block_size,
        list(lay.base_addrs),
        lay.block_len,
        lay.block_stride,
        lay.num_blocks,
        group.head_bytes or 0,
    )


def layout_mismatch(
    local: tuple[GroupLayout, ...],
    remote: list[GroupGeometry],
    heads: tuple[int, int] | None = None,
) -> str | None:
    """Why the decoder's KV layout cannot receive ours, or None when it can.

    ``heads``: (prefiller's, decoder's) KV heads per block when the TP sizes differ; then
    blocks differ in length by that ratio, and both sides must hold heads outermost with
    the same bytes per head.
    """

    def sig(kind: str, bs: int, regions: int, block_len: int) -> str:
        return f"{kind}/bs{bs}/{regions}x{block_len}B"

    def per_head(block_len: int, n: int) -> int:
        return block_len // n if heads is not None else block_len

    p_n, d_n = heads or (1, 1)
    mine = [
        sig(g.kind, g.block_size, len(g.layout.base_addrs), per_head(g.layout.block_len, p_n))
        for g in local
    ]
    theirs = [
        sig(g.kind, g.block_size, len(g.region_bases), per_head(g.block_len, d_n)) for g in remote
    ]
    if mine != theirs:
        what = "per KV head " if heads is not None else ""
        return f"KV cache group layout {what}differs: prefiller {mine}, decoder {theirs}"
    if heads is not None:
        for i, (g, r) in enumerate(zip(local, remote, strict=True)):
            if not g.head_bytes or g.head_bytes * p_n != g.layout.block_len:
                return (
                    f"group {i}: this prefiller's KV blocks do not hold heads outermost, so it "
                    "can only serve a decoder of the same TP size"
                )
            if r.head_bytes != g.head_bytes:
                return (
                    f"group {i}: the decoder's KV blocks do not hold heads outermost with "
                    f"{g.head_bytes} B per head (it says {r.head_bytes}); different TP sizes "
                    "need that on both sides"
                )
    return None
