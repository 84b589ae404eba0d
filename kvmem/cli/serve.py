"""`kvmem replica`, `kvmem serve`, `kvmem gateway`: the processes of a deployment (docs/deploy.md).

The replica is vLLM's own OpenAI server with kvmem's connector (this process execs it); serve and
gateway are the HTTP server, whose flags and settings live in kvmem.server (cli.py, settings.py)
so that `python -m kvmem.server` reads them the same way.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvmem.argtypes import positive_int
from kvmem.config import Config, ConfigError
from kvmem.config_overlay import add_engine_options


def cmd_replica(args: argparse.Namespace, config: Config) -> int:
    """Exec vLLM's server with kvmem's connector; --kv-shared-url reached config.kv through the overlay."""
    import shlex

    from kvmem.engine import replica
    from kvmem.model import resolve_model

    model = resolve_model(config.engine.model, config.models_dir, config.engine.dtype)
    cmd = replica.command(config, model, host=args.host, port=args.port)
    env = replica.environment(config)
    if args.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    os.execve(cmd[0], cmd, {**os.environ, **env})  # the replica is vLLM's process from here on


def run_server(args: argparse.Namespace) -> int:
    """`kvmem serve|gateway`: the server sets up its own logging and reads its own settings."""
    from kvmem.server import cli as server_cli

    if args.command == "serve" and not _vllm_args_ok(args):
        return 2
    return server_cli.run(args, gateway=args.command == "gateway")


def _vllm_args_ok(args: argparse.Namespace) -> bool:
    """Read the vLLM arguments (after `--`, or [engine] vllm_args) before serving: the server
    starts its engine in the background once the port is bound, so an unknown one would be
    reported there as a failed engine rather than as a usage error naming it."""
    from kvmem.engine.replica import engine_kwargs
    from kvmem.server.cli import settings_of

    try:
        _, config = settings_of(args, os.environ, gateway=False)
    except ConfigError:
        return True  # server_cli.run reports the settings' own errors
    if config.engine.url or not config.engine.vllm_args:
        return True
    try:
        engine_kwargs(config.engine.vllm_args)
    except ConfigError as e:
        print(f"kvmem serve: {e}", file=sys.stderr)
        return False
    return True


def add_parsers(sub) -> None:
    """replica, serve, gateway (an argparse table)."""
    from kvmem.server import cli as server_cli

    p = sub.add_parser("replica", help="run vLLM's stock OpenAI server with kvmem's connector (a replica)",
                       description="Start vLLM's own OpenAI-compatible server with kvmem's KV connector, reading "
                                   "and writing blobs in this home's KV folder (and the shared Redis tier, "
                                   "when given). `kvmem gateway --replicas http://HOST:PORT` (or `kvmem serve` "
                                   "with KVMEM_ENGINE_URL) then sends its requests there instead of starting "
                                   "vLLM itself. vLLM engine arguments kvmem has no flag for go after `--` and "
                                   "reach vLLM verbatim: kvmem replica -- --quantization fp8 --enforce-eager.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=positive_int, default=8000, help="port (default: 8000)")
    p.add_argument("--kv-shared-url", help="Redis URL of the shared KV tier (KVMEM_KV_SHARED_URL): blobs this "
                                           "replica lacks are pulled from there, and those it encodes stored there")
    p.add_argument("--print", action="store_true", help="print the command and environment, do not start it")
    add_engine_options(p)
    p.set_defaults(func=cmd_replica)

    for name, help_ in (("serve", "HTTP server: OpenAI-compatible chat with memory and a Mem0-shaped memory API "
                                  "(kvmem serve --help)"),
                        ("gateway", "the same HTTP server with no engine inside: sends prompts to replicas, facts "
                                    "in PostgreSQL, blobs in a shared Redis tier (kvmem gateway --help)")):
        p = sub.add_parser(name, help=help_, description=server_cli.__doc__, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        server_cli.add_arguments(p, gateway=name == "gateway")
        if name == "serve":  # a gateway starts no engine: its replicas take vLLM's flags
            add_engine_options(p)
        p.set_defaults(func=None)  # main() hands these to run_server before any Config is built
