"""Cost of the opt-in KV digest (``verify_digest``): keyed BLAKE3 over pushed blocks.

Both sides hash the blocks of one request: the prefiller its source blocks after the push,
the decoder what it received before reporting the load done. This prints, per request
size, the hash time next to a plain memcpy of the same bytes (what the TCP transfer itself
costs at best) on CPU memory laid out like vLLM's CPU KV cache.

    python -m scripts.bench.digest_cost [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from connector.digest import MemoryReader, keyed_digest, written_segments
from connector.layout import describe_kv_caches

# (label, layers, kv heads, head size, block size, blocks in the request)
CASES = [
    ("tiny model, 700-token prompt", 2, 2, 32, 32, 22),
    ("8B-like, 2k tokens (32 layers x 8 heads x 128)", 32, 8, 128, 32, 64),
    ("8B-like, 8k tokens", 32, 8, 128, 32, 256),
]


def run(reps: int) -> None:
    print(f"{'request':<48} {'bytes':>12} {'digest ms':>10} {'memcpy ms':>10} {'ratio':>6}")
    for label, layers, heads, head, bs, n in CASES:
        num_blocks = n + 8
        caches = {
            f"l{i}": torch.randn(num_blocks, heads, bs, 2 * head).to(torch.bfloat16)
            for i in range(layers)
        }
        mem = describe_kv_caches(caches, num_blocks)
        lay = mem.groups[0].layout
        ids = list(range(1, n + 1))
        addrs, lengths = written_segments(
            [ids], [(lay.base_addrs, lay.block_len, lay.block_stride)]
        )
        reader = MemoryReader(caches.values())
        total = sum(lengths)
        src = np.frombuffer(bytearray(total), dtype=np.uint8)
        dst = np.empty_like(src)
        hashes, copies = [], []
        for _ in range(reps):
            t = time.perf_counter()
            keyed_digest(reader, "secret", addrs, lengths)
            hashes.append(time.perf_counter() - t)
            t = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t)
        h, c = statistics.median(hashes) * 1e3, statistics.median(copies) * 1e3
        print(f"{label:<48} {total:>12,} {h:>10.3f} {c:>10.3f} {h / c:>6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    run(ap.parse_args().reps)


if __name__ == "__main__":
    main()
