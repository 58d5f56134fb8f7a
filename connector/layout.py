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

from connector.plan import RegionLayout


@dataclass(frozen=True)
class KVMemory:
    layout: RegionLayout
    # Disjoint (addr, length) spans covering every region: what the engine registers.
    spans: tuple[tuple[int, int], ...]
    num_layers: int


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


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> KVMemory:
    """Regions in layer order, deduplicated by base address (shared allocations count once)."""
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    bases: list[int] = []
    seen: set[int] = set()
    block_len = block_stride = -1
    for name, t in kv_caches.items():
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
    region_bytes = (num_blocks - 1) * block_stride + block_len
    layout = RegionLayout(tuple(bases), block_len, block_stride, num_blocks)
    return KVMemory(layout, merge_spans([(b, region_bytes) for b in bases]), len(kv_caches))


def merge_spans(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Union of (addr, length) intervals: the engine refuses overlapping registrations."""
    out: list[list[int]] = []
    for addr, length in sorted(spans):
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + length - out[-1][0])
        else:
            out.append([addr, length])
    return tuple((a, n) for a, n in out)
