"""The HTTP server: OpenAI-compatible chat with memory, a Mem0-shaped memory API, tenants, metrics.

`kvmem serve` (or `python -m kvmem.server`) runs it; `create_app` builds the ASGI app.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from kvmem.server.cli import serve_main

    return serve_main(argv)


def create_app(*args, **kwargs):
    from kvmem.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)
