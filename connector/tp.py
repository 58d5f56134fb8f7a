"""Which KV heads each tensor-parallel rank holds, and who pulls what from whom (pure).

vLLM splits a layer's KV heads across TP ranks: with ``tp <= H`` heads, rank ``r`` holds
heads ``[r*H/tp, (r+1)*H/tp)``; with ``tp > H`` each head is replicated on ``tp/H``
ranks and rank ``r`` holds head ``r*H // tp`` (MLA's latent KV is one such replicated
"head"). A prefiller at TP ``m`` and a decoder at TP ``n`` therefore hold different
slices of every block; each decoder rank covers its own heads with pulls from the
prefiller ranks that hold them, and every prefiller rank must hear from some decoder
rank (a pull, or a release when no decoder rank needs its copy), or its blocks would
wait for the expiry.

Both sides compute the same :func:`cover` from ``(H, m, n)``: the decoder to know whom
to ask, the prefiller to check a pull and to know how many pulls end a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class HeadSpan:
    """Global KV head indices ``[first, first + count)``."""

    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def overlap(self, other: HeadSpan) -> HeadSpan | None:
        lo, hi = max(self.first, other.first), min(self.end, other.end)
        return HeadSpan(lo, hi - lo) if hi > lo else None


@dataclass(frozen=True)
class Pull:
    """Decoder rank ``decode_rank`` copies ``heads`` from prefiller rank ``prefill_rank``."""

    decode_rank: int
    prefill_rank: int
    heads: HeadSpan


@dataclass(frozen=True)
class Cover:
    """Every pull, and the prefiller ranks each decoder rank releases (no pull needs them)."""

    pulls: tuple[Pull, ...]
    releases: tuple[tuple[int, int], ...]  # (decode_rank, prefill_rank)

    def pulls_of(self, decode_rank: int) -> list[Pull]:
        return [p for p in self.pulls if p.decode_rank == decode_rank]

    def releases_of(self, decode_rank: int) -> list[int]:
        return [p for d, p in self.releases if d == decode_rank]

    def owner_of(self, prefill_rank: int) -> int:
        """The one decoder rank that releases this prefiller rank when a request needs
        nothing (an abort, a prefix hit), so each rank hears exactly one release."""
        for p in self.pulls:
            if p.prefill_rank == prefill_rank:
                return p.decode_rank
        return next(d for d, q in self.releases if q == prefill_rank)

    def release_targets(self, decode_rank: int, num_prefill_ranks: int) -> list[int]:
        return [p for p in range(num_prefill_ranks) if self.owner_of(p) == decode_rank]

    def expected_at(self, prefill_rank: int) -> int:
        """How many pulls a prefiller rank gets per request (0: it gets one release)."""
        return sum(1 for p in self.pulls if p.prefill_rank == prefill_rank)


def check_tp(total_heads: int, tp: int, side: str = "") -> None:
    """The split vLLM itself accepts: one divides the other."""
    if total_heads < 1 or tp < 1:
        raise ValueError(f"{side}need at least one KV head and one rank ({total_heads}, {tp})")
    if (tp <= total_heads and total_heads % tp) or (tp > total_heads and tp % total_heads):
        raise ValueError(f"{side}{total_heads} KV heads do not split evenly over TP {tp}")


def rank_heads(total_heads: int, tp: int, rank: int) -> HeadSpan:
    check_tp(total_heads, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside TP {tp}")
    if tp <= total_heads:
        per = total_heads // tp
        return HeadSpan(rank * per, per)
    return HeadSpan(rank * total_heads // tp, 1)


@lru_cache(maxsize=256)
def cover(total_heads: int, prefill_tp: int, decode_tp: int) -> Cover:
    """The pulls for one request between a prefiller at TP ``m`` and a decoder at TP ``n``.

    Each decoder rank walks its heads and takes each run from a prefiller rank that holds
    it; where a head is replicated on several prefiller ranks, decoder ranks spread over
    the copies (rank ``d`` takes copy ``d mod copies``). Prefiller ranks left without a
    pull are released, each by one decoder rank (``p mod n``).
    """
    check_tp(total_heads, prefill_tp, "prefill: ")
    check_tp(total_heads, decode_tp, "decode: ")
    p_spans = [rank_heads(total_heads, prefill_tp, p) for p in range(prefill_tp)]
    pulls: list[Pull] = []
    for d in range(decode_tp):
        want = rank_heads(total_heads, decode_tp, d)
        h = want.first
        while h < want.end:
            holders = [p for p, s in enumerate(p_spans) if s.first <= h < s.end]
            p = holders[d % len(holders)]
            got = p_spans[p].overlap(HeadSpan(h, want.end - h))
            assert got is not None
            pulls.append(Pull(d, p, got))
            h = got.end
    pulled = {pull.prefill_rank for pull in pulls}
    releases = tuple((p % decode_tp, p) for p in range(prefill_tp) if p not in pulled)
    return Cover(tuple(pulls), releases)


@dataclass(frozen=True)
class Slice:
    """Where one pull's heads sit inside a block on each side, in bytes."""

    src_offset: int
    dst_offset: int
    length: int


def byte_slice(
    pull: Pull,
    total_heads: int,
    prefill_tp: int,
    decode_tp: int,
    head_bytes: int,
) -> Slice:
    """The pull's bytes within one block: heads are the outermost dim inside a block."""
    src = rank_heads(total_heads, prefill_tp, pull.prefill_rank)
    dst = rank_heads(total_heads, decode_tp, pull.decode_rank)
    return Slice(
        (pull.heads.first - src.first) * head_bytes,
        (pull.heads.first - dst.first) * head_bytes,
        pull.heads.count * head_bytes,
    )
