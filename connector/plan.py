"""Pure transfer planning: which bytes go where, as flat numpy arrays.

Everything here is I/O-free so it can be tested exhaustively. A *region* is one
contiguous KV allocation (one layer, or one K or V half of a layer on GPU layouts)
holding ``num_blocks`` blocks of ``block_len`` bytes every ``block_stride`` bytes.
Both sides enumerate their regions in the same order; block ``b`` of region ``r``
lives at ``base[r] + b * block_stride``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from connector.tp import Slice

_I64 = np.int64


@dataclass(frozen=True)
class RegionLayout:
    """One side's KV memory as seen by the transfer engine."""

    base_addrs: tuple[int, ...]
    block_len: int
    block_stride: int
    num_blocks: int

    @property
    def blocks_are_packed(self) -> bool:
        """Adjacent blocks touch, so a run of blocks is one byte range."""
        return self.block_stride == self.block_len


@dataclass(frozen=True)
class Runs:
    """Runs of blocks that are consecutive on both sides at once."""

    src_starts: np.ndarray
    dst_starts: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


@dataclass(frozen=True)
class TransferPlan:
    """Flat segment lists, ready for ``batch_transfer_sync_write``."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def concat(cls, plans: list[TransferPlan]) -> TransferPlan:
        if not plans:
            empty = np.zeros(0, dtype=_I64)
            return cls(empty, empty, empty)
        return cls(
            np.concatenate([p.src for p in plans]),
            np.concatenate([p.dst for p in plans]),
            np.concatenate([p.lengths for p in plans]),
        )

    def batches(
        self, max_segments: int, max_bytes: int | None = None
    ) -> Iterator[tuple[list[int], list[int], list[int]]]:
        """Yield slices of at most ``max_segments`` segments and ``max_bytes`` as lists.

        The engine rejects a batch with more in-flight segments per peer than its queue
        holds, so callers keep each call under that cap; the byte cap bounds how long one
        synchronous engine call may run. A single segment over ``max_bytes`` goes alone.
        """
        if max_segments <= 0:
            raise ValueError("max_segments must be positive")
        n = len(self)
        ends = np.cumsum(self.lengths) if max_bytes is not None else None
        lo = 0
        while lo < n:
            hi = min(lo + max_segments, n)
            if ends is not None:
                start = int(ends[lo - 1]) if lo else 0
                by_bytes = int(np.searchsorted(ends, start + max_bytes, side="right"))
                hi = max(lo + 1, min(hi, by_bytes))
            yield (
                self.src[lo:hi].tolist(),
                self.dst[lo:hi].tolist(),
                self.lengths[lo:hi].tolist(),
            )
            lo = hi


def _as_ids(ids: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=_I64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional")
    return arr


def contiguous_runs(
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
    *,
    merge: bool = True,
) -> Runs:
    """Group (src, dst) block pairs into runs that are consecutive on both sides.

    With ``merge=False`` every pair is its own run (used when blocks are strided).
    """
    src = _as_ids(src_ids, "src_ids")
    dst = _as_ids(dst_ids, "dst_ids")
    if src.shape != dst.shape:
        raise ValueError(
            f"block id lists differ in length: {src.shape[0]} local vs {dst.shape[0]} remote"
        )
    n = src.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=_I64)
        return Runs(empty, empty, empty)
    if not merge:
        return Runs(src, dst, np.ones(n, dtype=_I64))
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    ends = np.concatenate((starts[1:], [n]))
    return Runs(src[starts], dst[starts], (ends - starts).astype(_I64))


def check_block_ids(ids: np.ndarray, num_blocks: int, side: str) -> None:
    """Refuse ids outside ``[0, num_blocks)`` so nothing is read or written out of range."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(
            f"{side} block id out of range [0, {num_blocks}): "
            f"min {int(ids.min())}, max {int(ids.max())}"
        )


def build_transfer_plan(
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
    src: RegionLayout,
    dst: RegionLayout,
    part: Slice | None = None,
) -> TransferPlan:
    """Segments that copy blocks ``src_ids`` of every source region onto ``dst_ids``.

    Region ``r`` on one side maps to region ``r`` on the other. Runs are merged only
    where both sides pack blocks back to back; the arithmetic is one broadcast over
    all regions and runs, so it stays cheap for 100k blocks x many layers.

    ``part``: only these bytes of each block (a slice of KV heads, when the two sides
    split heads over different TP sizes); a part that is a whole block on both sides is
    the plain copy.
    """
    if len(src.base_addrs) != len(dst.base_addrs):
        raise ValueError(
            f"region count differs: {len(src.base_addrs)} local vs {len(dst.base_addrs)} remote"
        )
    whole = part is None or (
        part.src_offset == part.dst_offset == 0 and part.length == src.block_len == dst.block_len
    )
    if part is None and src.block_len != dst.block_len:
        raise ValueError(f"block length differs: {src.block_len} local vs {dst.block_len} remote")
    if part is not None:
        if part.length <= 0 or part.src_offset < 0 or part.dst_offset < 0:
            raise ValueError(f"empty or negative block slice {part}")
        if part.src_offset + part.length > src.block_len:
            raise ValueError(f"slice {part} outside the local block of {src.block_len} B")
        if part.dst_offset + part.length > dst.block_len:
            raise ValueError(f"slice {part} outside the remote block of {dst.block_len} B")
    s_ids = _as_ids(src_ids, "src_ids")
    d_ids = _as_ids(dst_ids, "dst_ids")
    check_block_ids(s_ids, src.num_blocks, "local")
    check_block_ids(d_ids, dst.num_blocks, "remote")
    merge = whole and src.blocks_are_packed and dst.blocks_are_packed
    runs = contiguous_runs(s_ids, d_ids, merge=merge)
    src_off = dst_off = 0
    seg_len = src.block_len
    if not whole:
        assert part is not None
        src_off, dst_off, seg_len = part.src_offset, part.dst_offset, part.length
    src_base = np.asarray(src.base_addrs, dtype=_I64)[:, None] + src_off
    dst_base = np.asarray(dst.base_addrs, dtype=_I64)[:, None] + dst_off
    src_addr = src_base + runs.src_starts[None, :] * src.block_stride
    dst_addr = dst_base + runs.dst_starts[None, :] * dst.block_stride
    lengths = np.broadcast_to(runs.lengths[None, :] * seg_len, src_addr.shape)
    return TransferPlan(src_addr.ravel(), dst_addr.ravel(), np.ascontiguousarray(lengths).ravel())
