"""The KV codecs' names, apart from their tensor code (codec.py), so that checking a config's
codec does not import torch (every `kvmem` command reads the config; most need no torch)."""

from __future__ import annotations

from kvmem.errors import InvalidInputError

CODECS = ("none", "fp8", "int8", "int4", "k8v4", "k4v8", "int7", "int6", "int4h", "k7v8")


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise InvalidInputError(f"unknown KV codec {name!r}; choose one of {', '.join(CODECS)}", param="codec")
    return name
