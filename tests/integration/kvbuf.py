"""KV buffers laid out like vLLM's CPU backend, filled with reproducible bytes."""

from __future__ import annotations

import torch


def make_caches(cfg: dict, seed: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One uint8 allocation viewed as per-layer [num_blocks, heads, block_size, 2*head] bf16."""
    nb, layers, heads, bs, hd = (
        cfg[k] for k in ("num_blocks", "layers", "heads", "block_size", "head")
    )
    per_layer = nb * heads * bs * 2 * hd * 2
    if seed is None:
        buf = torch.zeros(layers * per_layer, dtype=torch.uint8)
    else:
        gen = torch.Generator().manual_seed(seed)
        buf = torch.randint(0, 256, (layers * per_layer,), dtype=torch.uint8, generator=gen)
    caches = {
        f"model.layers.{i}.attn": buf[i * per_layer : (i + 1) * per_layer]
        .view(torch.bfloat16)
        .view(nb, heads, bs, 2 * hd)
        for i in range(layers)
    }
    return buf, caches


def block_bytes(caches: dict[str, torch.Tensor], layer: int, block: int) -> bytes:
    t = list(caches.values())[layer]
    return t[block].contiguous().view(torch.uint8).numpy().tobytes()


def head_bytes(caches: dict[str, torch.Tensor], layer: int, block: int, head: int) -> bytes:
    t = list(caches.values())[layer]
    return t[block, head].contiguous().view(torch.uint8).numpy().tobytes()
