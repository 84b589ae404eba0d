"""`kvmem serve`: the HTTP server on the real engine, in-process, on the embedded defaults.

    kvmem serve [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [--model M] [--config FILE.toml]

`kvmem gateway`: the same server with no engine inside: it sends prompts to `kvmem replica`
processes over HTTP, and keeps facts in PostgreSQL and blobs in a shared Redis tier, so several
gateways and replicas can run side by side (docs/deploy.md).

    kvmem gateway --replicas URL[,URL...] [--database-url postgresql://...] [--kv-shared-url redis://...]

With no API keys configured (KVMEM_API_KEYS or [tenants] in --config) the server is open and
binds a loopback address only, unless --allow-public-without-keys says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvmem.server.settings import SettingsError, load

log = logging.getLogger("kvmem.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmem serve", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--data-dir", type=Path, help="facts and KV blobs (default: $KVMEM_HOME or ~/.cache/kvmem)")
    p.add_argument("--model", help="a bundled model (smollm2-135m, gemma3-270m), a local HF model folder or "
                                   "hub id (default: the bundled SmolLM2-135M)")
    p.add_argument("--models-home", type=Path, help="where converted models are kept (default: ~/.cache/kvmem/models)")
    p.add_argument("--config", type=Path, help="a TOML file: [server], [tenants] (API keys), [engine], [memory], ...")
    p.add_argument("--max-inflight", type=int, help="chat requests answered at once; more get 429 (default 64)")
    p.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    p.add_argument("--served-model-name", help="the model id clients use (the alias 'kvmem' always works too)")
    p.add_argument("--allow-public-without-keys", action="store_true", default=None,
                   help="bind a non-loopback address with no API keys configured (anyone can read any memory)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO, vLLM included")
    return p


def build_gateway_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "kvmem gateway"
    p.add_argument("--replicas", help="comma-separated base URLs of `kvmem replica` processes (KVMEM_ENGINE_URL)")
    p.add_argument("--database-url", help="PostgreSQL URL for facts, history and vectors (KVMEM_DATABASE_URL); "
                                          "without it, SQLite in --data-dir (one gateway only)")
    p.add_argument("--kv-shared-url", help="Redis URL of the shared KV tier (KVMEM_KV_SHARED_URL); without it, "
                                           "the replicas and this gateway must share one KV folder")
    return p


_GATEWAY_FLAGS = ("replicas", "database_url", "kv_shared_url")


def serve_main(argv: list[str] | None = None, *, gateway: bool = False) -> int:
    name = "kvmem gateway" if gateway else "kvmem serve"
    args = (build_gateway_parser() if gateway else build_parser()).parse_args(argv)
    _logging(args.verbose)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "verbose", *_GATEWAY_FLAGS)}
    try:
        settings, config = load(args.config, os.environ, flags)
        if gateway:
            config = _gateway_config(config, args)
    except SettingsError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    if not settings.api_keys:
        if settings.public and not settings.allow_public_without_keys:
            print(f"{name}: refusing to bind {settings.host} with no API keys configured; set KVMEM_API_KEYS "
                  "or [tenants] in --config, or pass --allow-public-without-keys", file=sys.stderr)
            return 2
        log.warning("no API keys configured: the server is OPEN (no authentication) on %s:%d%s", settings.host,
                    settings.port, "" if settings.public else " (loopback only)")
    else:
        log.info("API keys configured for %d tenants", len(set(settings.api_keys.values())))
    return _run(settings, config)


def _gateway_config(config, args):
    """Flags over the environment; a gateway without a replica to send to is refused."""
    from dataclasses import replace

    engine = replace(config.engine, url=args.replicas or config.engine.url)
    if not engine.url:
        raise SettingsError("a gateway needs replicas: --replicas URL[,URL...] or KVMEM_ENGINE_URL")
    kv = replace(config.kv, shared_url=args.kv_shared_url or config.kv.shared_url)
    return replace(config, engine=engine, kv=kv, database_url=args.database_url or config.database_url)


def _run(settings, config) -> int:
    import uvicorn

    from kvmem.server.app import create_app

    failed = []

    def on_engine_failure() -> None:
        failed.append(True)
        server.should_exit = True

    app = create_app(settings, config, on_engine_failure=on_engine_failure)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                                           timeout_graceful_shutdown=int(settings.graceful_timeout_s),
                                           log_level="info"))
    log.info("kvmem serve: data in %s; the engine loads in the background (/health answers 503 until ready)",
             config.home)
    server.run()
    return 1 if failed else 0


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("kvmem").setLevel(logging.INFO)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars
