"""kvmem's command line (`kvmem`, `python -m kvmem.cli`); `main` is the console script.

One module per concern: parser.py (the command table and the options every command shares),
memory.py (add, search, chat, forget, reembed), inspect_cmd.py (list, get, history, update,
stats), transfer_cmd.py (export, import), demo.py, serve.py (replica, serve, gateway),
config_cmd.py (config show); `kvmem bench|eval` and `kvmem tune-reader` bring their own tables
(kvmem/bench/cli.py, kvmem/tune/cli.py). Every command's Config comes from one overlay
(kvmem/config_overlay.py): defaults < --config file < KVMEM_* variables < flags. This package is
the top layer: nothing in kvmem imports it.
"""

from __future__ import annotations

import logging
import os
import sys

from kvmem.cli.parser import build_parser, leaf_commands
from kvmem.config_overlay import from_args
from kvmem.errors import KvmemError

__all__ = ["build_parser", "leaf_commands", "main"]

# Commands that load no Hugging Face model (search embeds its query in NumPy; config only reads
# settings), so they skip transformers' import (a second of a cold start) that quieting its
# progress bars costs, and run where transformers is not installed (tests/test_wheel.py).
LIGHT_COMMANDS = frozenset({"list", "get", "history", "stats", "export", "search", "config"})


def main(argv: list[str] | None = None) -> int:
    """Parse, build the Config through the overlay, run the command: 0 on success, 1 on a kvmem
    error (said on stderr), 2 on a usage error (argparse)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func is None:  # serve, gateway: the server sets up its own logging and settings
        from kvmem.cli.serve import run_server

        return run_server(args)
    if args.command == "forget" and not args.all and not args.ids:
        parser.error("forget: give fact ids or --all")
    _quiet_logs(args.verbose, hf=args.command not in LIGHT_COMMANDS)
    try:
        return args.func(args, from_args(args).config)
    except KvmemError as e:
        print(f"kvmem: {e}", file=sys.stderr)
        return 1


def _quiet_logs(verbose: bool, hf: bool = True) -> None:
    """WARNING and up only, unless -v: kvmem's progress bars stay, the libraries' chatter goes
    (`hf`: the command may load a Hugging Face model, whose bars go too)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose and hf:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars on every command; kvmem's own bars stay
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is imported; -v keeps its INFO lines
