"""Entry point for ``python -m scripts.loadgen`` and the ``pd-loadgen`` console script."""

from __future__ import annotations

import sys

from scripts.loadgen.cli import main as _cli_main


def main(argv: list[str] | None = None) -> int:
    return _cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
