"""Opt-in end-to-end check of pushed KV bytes: a keyed BLAKE3 hash over what moved.

The transfer engine writes straight into the decoder's memory and checks nothing, so
corruption on the path, or a write by anyone who can reach the engine's port, would be
decoded silently. With ``verify_digest`` the decoder asks the prefiller for a digest of
the source bytes, keyed with the request's secret (which a tamperer off the side channel
does not know), recomputes it over the blocks it received, and fails the load (vLLM then
recomputes or fails the request) when they differ.

Both sides hash the same byte stream: per group, per region, the blocks in pairing
order, whatever the segmentation. Reading goes through torch, so accelerator memory
works too (copied to the host block run by block run).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import blake3
import numpy as np
import torch

from connector.plan import contiguous_runs
from connector.tp import Slice

DIGEST_SIZE = 32


class MemoryReader:
    """Bytes of registered KV memory by address, for any device."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        # Views are made on first use only: most instances never hash anything.
        self._tensors = list(tensors)
        self._stores: list[tuple[int, int, torch.Tensor]] | None = None

    def _views(self) -> list[tuple[int, int, torch.Tensor]]:
        if self._stores is None:
            stores: dict[int, tuple[int, torch.Tensor]] = {}
            for t in self._tensors:
                storage = t.untyped_storage()
                base = storage.data_ptr()
                if base not in stores:
                    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                    stores[base] = (storage.nbytes(), flat)
            self._stores = sorted((b, n, f) for b, (n, f) in stores.items())
        return self._stores

    def read(self, addr: int, length: int) -> np.ndarray:
        for base, nbytes, flat in self._views():
            if base <= addr and addr + length <= base + nbytes:
                part = flat[addr - base : addr - base + length]
                return (part if part.device.type == "cpu" else part.cpu()).numpy()
        raise ValueError(f"{length} bytes at {addr:#x} are outside every KV allocation")


def keyed_digest(
    reader: MemoryReader, secret: str, addrs: Sequence[int], lengths: Sequence[int]
) -> bytes:
    # BLAKE3's keyed mode (a MAC) takes exactly 32 key bytes.
    h = blake3.blake3(key=hashlib.sha256(secret.encode()).digest())
    for addr, length in zip(addrs, lengths, strict=True):
        h.update(reader.read(int(addr), int(length)))
    return h.digest(DIGEST_SIZE)


def written_segments(
    written: Sequence[Sequence[int]],
    layouts: Sequence[tuple[tuple[int, ...], int, int]],
    slices: Sequence[Slice] | None = None,
) -> tuple[list[int], list[int]]:
    """The decoder's byte ranges for ``written`` blocks, in the prefiller's plan order.

    ``layouts``: per group (region base addresses, block_len, block_stride); ``slices``:
    per group, the part of each block that was written (different TP sizes).
    """
    addrs: list[int] = []
    lengths: list[int] = []
    for g, (ids, (bases, block_len, stride)) in enumerate(zip(written, layouts, strict=True)):
        if not ids:
            continue
        part = slices[g] if slices is not None else None
        whole = part is None or (part.dst_offset == 0 and part.length == block_len)
        offset, seg = (0, block_len) if part is None else (part.dst_offset, part.length)
        runs = contiguous_runs(ids, ids, merge=whole and stride == block_len)
        for base in bases:
            addrs.extend((base + offset + runs.src_starts * stride).tolist())
            lengths.extend((runs.lengths * seg).tolist())
    return addrs, lengths
