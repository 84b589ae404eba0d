"""The `kvmem` argument parser: the top-level options, each concern's subcommand table, and the
options every command shares (--home, --models-home, --model, --config, -v), which are put on
every subcommand here, after the tables are built, so that none can forget them and each works
before or after the subcommand's name."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kvmem.config_overlay import add_common_options

DESCRIPTION = """kvmem command line: store, search, chat with and forget a user's memory; `kvmem demo` shows it all.

Memory lives in the data folder (--home, default $KVMEM_HOME or ~/.cache/kvmem). `add --no-encode`,
`search`, `forget`, `reembed`, `list`, `get`, `history`, `update`, `stats`, `export` and `import` never
start the inference engine, and `search`, `list`, `get`, `history`, `stats`, `export` and `import` do
not even read the chat model (docs/cli.md); `add`, `chat` and `demo` start it (vLLM, about a minute
on a CPU host). Every command takes --home, --models-home, --model, --config and -v, before
or after its name; `kvmem config show` prints the configuration they give and where each value
came from (defaults < --config file < KVMEM_* variables < flags).
"""

SERVERS = ("serve", "gateway")  # parse their flags with kvmem.server's table; also read --data-dir


def build_parser() -> argparse.ArgumentParser:
    """The whole command table (an argparse table)."""
    from kvmem.bench import cli as bench_cli
    from kvmem.cli import config_cmd, demo, inspect_cmd, mcp_cmd, memory, serve, transfer_cmd
    from kvmem.tune import cli as reader_cli

    # allow_abbrev=False: else chat's --mode would be read as an ambiguous prefix of --model/--models-home.
    parser = argparse.ArgumentParser(prog="kvmem", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    memory.add_parsers(sub)
    inspect_cmd.add_parsers(sub)
    transfer_cmd.add_parsers(sub)
    demo.add_parser(sub)
    serve.add_parsers(sub)
    mcp_cmd.add_parser(sub)
    reader_cli.add_bench_parser(bench_cli.add_parsers(sub))
    reader_cli.add_parser(sub)
    config_cmd.add_parsers(sub)
    for path, leaf in leaf_commands(parser):
        add_common_options(leaf, suppress=True, data_dir_alias=path[0] in SERVERS)
    return parser


def leaf_commands(parser: argparse.ArgumentParser,
                  path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command path, its parser) for every runnable command: ("add",), ("bench", "ttft"), ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from leaf_commands(child, (*path, name))
