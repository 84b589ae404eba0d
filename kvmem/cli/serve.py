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
from kvmem.facts import is_postgres


def cmd_replica(args: argparse.Namespace, config: Config) -> int:
    """Exec vLLM's server with kvmem's connector; --kv-shared-url reached config.kv through the overlay.
    With --database-url (a PostgreSQL URL) this process stays as the server's parent and keeps it
    registered while it serves (engine/replica_lease.py); --drain URL only marks one draining."""
    if args.drain:  # before the imports below, which load torch: a drain is one UPDATE
        return _drain(args.drain, config)
    import shlex

    from kvmem.engine import replica
    from kvmem.model import resolve_model

    model = resolve_model(config.engine.model, config.models_dir, config.engine.dtype)
    local, advertised = _urls(args)
    cmd = replica.command(config, model, host=args.host, port=args.port, advertise_url=advertised)
    env = replica.environment(config)
    if args.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    if is_postgres(config.database_url):
        from kvmem.engine.membership import Registry
        from kvmem.engine.replica_lease import supervise

        return supervise(cmd, {**os.environ, **env}, Registry(config.database_url), advertised,
                         model.fingerprint, local_url=local, drain_s=args.drain_seconds)
    os.execve(cmd[0], cmd, {**os.environ, **env})  # the replica is vLLM's process from here on


def _urls(args: argparse.Namespace) -> tuple[str, str]:
    """(where this host reaches the replica, the URL it registers and publishes its RAM tier
    under: --advertise-url, else the host's name when it listens everywhere)."""
    import socket

    anywhere = args.host in ("0.0.0.0", "::")
    local = f"http://{'127.0.0.1' if anywhere else args.host}:{args.port}"
    advertised = args.advertise_url or (f"http://{socket.getfqdn()}:{args.port}" if anywhere else local)
    return local, advertised.rstrip("/")


def _drain(url: str, config: Config) -> int:
    """`kvmem replica --drain URL`: gateways send that replica nothing new from their next read."""
    from kvmem.engine.membership import Registry

    if not config.database_url:
        print("kvmem replica --drain needs --database-url (the membership table's PostgreSQL)", file=sys.stderr)
        return 2
    if not Registry(config.database_url, create=False).drain(url.rstrip("/")):
        print(f"kvmem replica --drain: {url} is not registered", file=sys.stderr)
        return 1
    print(f"{url} drains: gateways send it nothing new; stop it once its requests are done")
    return 0


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
    p.add_argument("--database-url", help="PostgreSQL URL of the membership table (KVMEM_DATABASE_URL): the replica "
                                          "registers there while it serves, and gateways without --replicas find it")
    p.add_argument("--advertise-url", help="the URL gateways reach this replica at (default: http://HOST:PORT; "
                                           "with --host 0.0.0.0, this machine's host name)")
    p.add_argument("--drain", metavar="URL", help="mark the registered replica at URL draining and exit: gateways "
                                                 "send it nothing new, what it has finishes")
    p.add_argument("--drain-seconds", type=float, default=5.0,
                   help="on SIGTERM, seconds a registered replica drains before its server stops (default: 5)")
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
