"""A model's cached `kvmem verify` verdict: `<home>/verify/<fingerprint>.json`.

Keyed by the fingerprint, not the model's name: new weights, another dtype or another KV
format are another model, whose KV injection has not been checked. Chat mode "auto" reads it
on every chat (a small file), so a verdict written while a server runs takes effect at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FOLDER = "verify"


def verdict_path(home: Path | str, fingerprint: str) -> Path:
    return Path(home) / FOLDER / f"{fingerprint}.json"


def save(home: Path | str, fingerprint: str, verdict: dict) -> Path:
    """Write atomically: a server reading it mid-write must see the old verdict or the new one."""
    path = verdict_path(home, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**verdict, "fingerprint": fingerprint}, indent=2))
    os.replace(tmp, path)
    return path


def load(home: Path | str, fingerprint: str) -> dict | None:
    """The cached verdict, or None when there is none (or it is unreadable, or for another model)."""
    try:
        verdict = json.loads(verdict_path(home, fingerprint).read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and verdict.get("fingerprint") == fingerprint else None


def passed(home: Path | str, fingerprint: str) -> bool:
    """True only for a verdict that passed; no verdict counts as not passed (the safe side)."""
    verdict = load(home, fingerprint)
    return bool(verdict and verdict.get("passed") is True)
