"""KV cache groups as the connector sees them: kind, block size and layers per group.

Hybrid models (HMA) keep full-attention and sliding-window layers in separate groups,
each with its own block table. Both sides of a transfer must agree on this layout, so it
travels in every pull and a mismatch is refused before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class GroupSpec:
    # "full", "sliding:<window>", "chunked:<size>": what decides which blocks are live.
    kind: str
    block_size: int
    layer_names: tuple[str, ...]


def group_specs(kv_cache_config: KVCacheConfig) -> tuple[GroupSpec, ...]:
    """The transfer groups of a vLLM KV cache config, in vLLM's group order."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        SlidingWindowSpec,
    )

    out = []
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            kind = f"sliding:{spec.sliding_window}"
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            kind = f"chunked:{spec.attention_chunk_size}"
        elif isinstance(spec, AttentionSpec):
            kind = "full"
        else:
            raise NotImplementedError(
                f"P2pMooncakeConnector moves attention KV blocks only; a {type(spec).__name__} "
                "group (e.g. Mamba state) is not supported"
            )
        out.append(GroupSpec(kind, spec.block_size, tuple(group.layer_names)))
    return tuple(out)


def pair_blocks(local_ids: list[int], remote_ids: list[int]) -> tuple[list[int], list[int]]:
    """Pair one group's block slots, tail-aligned; slots holding the null block 0 are skipped.

    Both lists are positional (slot i = tokens i*block_size...). The decoder asks only for the
    slots after its local prefix, so they align with the prefiller's tail. Sliding-window
    groups mark out-of-window slots with the null block 0 on either side: such a pair is
    never transferred, so no real block is written from, or into, the shared null block.
    """
    if len(remote_ids) > len(local_ids):
        raise ValueError(
            f"decoder asked for {len(remote_ids)} blocks but only {len(local_ids)} were computed"
        )
    tail = local_ids[len(local_ids) - len(remote_ids) :] if remote_ids else []
    src, dst = [], []
    for s, d in zip(tail, remote_ids, strict=True):
        if s and d:
            src.append(s)
            dst.append(d)
    return src, dst
