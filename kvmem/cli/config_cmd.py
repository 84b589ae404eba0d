"""`kvmem config show`: the effective configuration and where each value came from.

It prints what the other commands would run with for the same --home, --model, --config and
environment (kvmem/config_overlay.py): every setting, its value, and its source: default, file
(which file and table), env (which variable) or flag (which flag).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvmem.config import Config
from kvmem.config_overlay import Resolved, from_args


def cmd_config_show(args: argparse.Namespace, config: Config) -> int:
    """Print the overlay's rows; config is what main() resolved from the same args."""
    resolved = from_args(args)
    print(json.dumps(as_json(resolved), indent=1, ensure_ascii=False) if args.json else as_table(resolved))
    return 0


def as_json(resolved: Resolved) -> dict[str, dict[str, Any]]:
    """{key: {"value", "source", "from"}}: "from" names the variable, file or flag ("" for a default)."""
    return {key: {"value": _plain(value), "source": source.kind, "from": source.detail}
            for key, value, source in resolved.rows()}


def as_table(resolved: Resolved) -> str:
    """One line per setting: key, value (as JSON, so "none" and null differ), source."""
    rows = [(key, json.dumps(_plain(value), ensure_ascii=False), str(source)) for key, value, source in resolved.rows()]
    key_width = max(len(r[0]) for r in rows)
    value_width = max((len(r[1]) for r in rows if len(r[1]) <= 40), default=5)  # longer ones overflow
    lines = [f"{'key':{key_width}}  {'value':{value_width}}  source"]
    lines += [f"{key:{key_width}}  {value:{value_width}}  {source}" for key, value, source in rows]
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def add_parsers(sub) -> None:
    """config show (an argparse table)."""
    p = sub.add_parser("config", help="show the effective configuration and where each value came from",
                       description="Inspect the configuration the other commands run with: defaults, then "
                                   "the --config file, then KVMEM_* variables, then flags.")
    actions = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="every setting, its value and its source (default, file, env, flag)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    show.set_defaults(func=cmd_config_show)
