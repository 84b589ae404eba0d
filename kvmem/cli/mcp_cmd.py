"""`kvmem mcp`: the memory tools over stdio for one agent, on a data folder (kvmem/mcp/).

The scope is fixed for the process (--user, --agent, --run); the tenant comes from KVMEM_API_KEY
when API keys are configured (KVMEM_API_KEYS or [tenants] in --config, as for `kvmem serve`), so
the process reaches the same ids the server stores for that tenant. Without --engine it starts
no vLLM: added facts are stored and indexed, and their KV is encoded the next time an engine
opens the folder (`kvmem serve`); infer=True then needs an [extract] url.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from kvmem.config import Config, ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("mcp", help="MCP server over stdio: memory tools for an agent (docs/agents.md)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--user", required=True, help="whose memory the tools read and write (user id)")
    p.add_argument("--agent", help="narrow the tools to one agent id")
    p.add_argument("--run", help="narrow the tools to one run (session) id")
    p.add_argument("--engine", action="store_true",
                   help="start vLLM: added facts get their KV at once, and infer=True uses the served model")
    p.set_defaults(func=cmd_mcp)


def cmd_mcp(args: argparse.Namespace, config: Config) -> int:
    """Resolve the caller, open the folder (fd 1 pointed at stderr meanwhile: vLLM logs to stdout,
    which is the protocol's channel), then serve until the client hangs up."""
    from kvmem.mcp.caller import Caller
    from kvmem.mcp.server import run_stdio
    from kvmem.server.settings import load
    from kvmem.server.tenants import KeyRing
    from kvmem.service import KVMem

    try:
        keys = KeyRing(load(getattr(args, "config_file", None), os.environ, {})[0].api_keys)
        key = os.environ.get("KVMEM_API_KEY")
        caller = Caller.of(keys.tenant(f"Bearer {key}" if key else None), args.user, args.agent, args.run)
    except (ConfigError, ValueError) as e:
        print(f"kvmem mcp: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the key ring's 401: no key, or an unknown one
        if getattr(e, "code", None) is None:
            raise
        print(f"kvmem mcp: {e} (set KVMEM_API_KEY to a key of your tenant)", file=sys.stderr)
        return 2
    with _stdout_to_stderr():
        mem = KVMem(config, start_engine=args.engine, background=args.engine)
    with mem:
        run_stdio(mem, caller, encode="background" if args.engine else "none")
    return 0


@contextlib.contextmanager
def _stdout_to_stderr():
    """Point fd 1 at stderr for the block; processes started inside keep writing there."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
