"""`kvmem serve`: the HTTP server on the real engine, in-process, on the embedded defaults.

    kvmem serve [--host 127.0.0.1] [--port 8000] [--home DIR] [--model M] [--config FILE.toml]

`kvmem gateway`: the same server with no engine inside: it sends prompts to `kvmem replica`
processes over HTTP, and keeps facts in PostgreSQL and blobs in a shared Redis tier, so several
gateways and replicas can run side by side (docs/deploy.md).

    kvmem gateway --replicas URL[,URL...] [--database-url postgresql://...] [--kv-shared-url redis://...]
    kvmem gateway --database-url postgresql://... [--kv-shared-url redis://...]   (replicas that register)

With no API keys configured (KVMEM_API_KEYS or [tenants] in --config) the server is open and
binds a loopback address only, unless --allow-public-without-keys says otherwise.

On SIGTERM (or Ctrl-C) the server drains: new requests get 503 with Retry-After while those in
flight finish (up to the graceful timeout), then it stops; a second signal stops it at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace

from kvmem.config import Config, ConfigError
from kvmem.config_overlay import add_common_options, add_engine_options
from kvmem.facts import is_postgres
from kvmem.server.settings import ServerSettings, SettingsError, load

log = logging.getLogger("kvmem.server")


def add_arguments(p: argparse.ArgumentParser, *, gateway: bool) -> None:
    """The server's own flags, on `python -m kvmem.server`'s parser and on `kvmem serve`'s and
    `kvmem gateway`'s (the common --home, --model, --config, ... are added beside them)."""
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--max-inflight", type=int, help="chat requests answered at once; more get 429 (default 64)")
    p.add_argument("--rate-limit-per-min", type=int, metavar="N",
                   help="requests a minute per tenant, across every gateway on the same --kv-shared-url Redis; "
                        "more get 429 (default: unlimited)")
    p.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    p.add_argument("--served-model-name", help="the model id clients use (the alias 'kvmem' always works too)")
    p.add_argument("--allow-public-without-keys", action="store_true", default=None,
                   help="bind a non-loopback address with no API keys configured (anyone can read any memory)")
    if gateway:
        p.add_argument("--replicas", help="comma-separated base URLs of `kvmem replica` processes (KVMEM_ENGINE_URL); "
                                          "without it, the replicas registered in --database-url's PostgreSQL")
        p.add_argument("--routing", choices=("rendezvous", "residency"),
                       help="which replica a KV-mode chat goes to: the user's by hashing (rendezvous, the "
                            "default) or where its facts' KV is in RAM (residency; needs --kv-shared-url) "
                            "(KVMEM_ENGINE_ROUTING)")
        p.add_argument("--database-url", help="PostgreSQL URL for facts, history and vectors (KVMEM_DATABASE_URL); "
                                              "without it, SQLite in --home (one gateway only)")
        p.add_argument("--kv-shared-url", help="Redis URL of the shared KV tier (KVMEM_KV_SHARED_URL); without it, "
                                               "the replicas and this gateway must share one KV folder")


def build_parser(*, gateway: bool = False) -> argparse.ArgumentParser:
    """The parser of `python -m kvmem.server` (serve_main), standing alone."""
    p = argparse.ArgumentParser(prog="kvmem gateway" if gateway else "kvmem serve", description=__doc__,
                                allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(p, suppress=False, data_dir_alias=True)
    add_arguments(p, gateway=gateway)
    if not gateway:  # the gateway starts no engine
        add_engine_options(p)
    return p


def build_gateway_parser() -> argparse.ArgumentParser:
    return build_parser(gateway=True)


def serve_main(argv: list[str] | None = None, *, gateway: bool = False) -> int:
    return run(build_parser(gateway=gateway).parse_args(argv), gateway=gateway)


def run(args: argparse.Namespace, *, gateway: bool) -> int:
    """Serve with parsed flags: from serve_main, or from `kvmem serve|gateway` (kvmem.cli)."""
    name = "kvmem gateway" if gateway else "kvmem serve"
    _logging(args.verbose)
    try:
        settings, config = settings_of(args, os.environ, gateway=gateway)
    except ConfigError as e:
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


def settings_of(args: argparse.Namespace, env: Mapping[str, str], *,
                gateway: bool) -> tuple[ServerSettings, Config]:
    """The settings and Config these flags give, through the one overlay (settings.load); a
    gateway without a replica to send to is refused."""
    settings, config = load(getattr(args, "config_file", None), env, vars(args))
    if gateway and not config.engine.url:
        if not is_postgres(config.database_url):
            raise SettingsError("a gateway needs replicas: --replicas URL[,URL...] (KVMEM_ENGINE_URL), or "
                                "--database-url postgresql://... where `kvmem replica --database-url` registers them")
        config = replace(config, engine=replace(config.engine, members=True))  # the replicas that register
    return settings, config


def _run(settings, config) -> int:
    import uvicorn

    from kvmem.server.app import create_app

    failed = []

    def on_engine_failure() -> None:
        failed.append(True)
        server.should_exit = True

    app = create_app(settings, config, on_engine_failure=on_engine_failure)
    server = _draining_server(uvicorn, uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                                                      timeout_graceful_shutdown=int(settings.graceful_timeout_s),
                                                      log_level="info"),
                              app.state.runtime, settings.graceful_timeout_s)
    log.info("kvmem serve: data in %s; the engine loads in the background (/health answers 503 until ready)",
             config.home)
    server.run()
    return 1 if failed else 0


def _draining_server(uvicorn, config, runtime, drain_s: float):
    """uvicorn's server, but the first SIGTERM/SIGINT drains before it stops: uvicorn's own
    shutdown closes the port at once, so a caller would meet a refused connection, not a 503,
    and a load balancer's health check could not see the instance leave first."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # runs in the main thread, as a signal handler
            if runtime.draining or self.should_exit:
                super().handle_exit(sig, frame)  # a second signal: uvicorn's own (forced) exit
                return
            runtime.draining = True
            self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
            log.info("signal %d: draining (new requests get 503) for up to %.0f s", sig, drain_s)
            threading.Thread(target=self._drain, name="kvmem-drain", daemon=True).start()

        def _drain(self) -> None:
            idle = runtime.drain(drain_s)
            log.info("drained%s; stopping", "" if idle else f": requests still in flight after {drain_s:.0f} s")
            self.should_exit = True

    return Server(config)


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("kvmem").setLevel(logging.INFO)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars
