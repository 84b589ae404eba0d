"""argparse value types shared by every command table (kvmem.cli, bench/cli.py, tune/cli.py).

They live at the bottom of the package, importing nothing of kvmem, so the command modules of
bench/ and tune/ can use them without importing kvmem.cli, which sits above them and imports
them in turn.
"""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """An int >= 1 (counts, sizes, ports): argparse reports anything else as a usage error."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(value: str) -> int:
    """An int >= 0 (windows, optional counts where 0 means none)."""
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n
