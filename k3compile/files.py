"""Files the on-disk caches write (compiled kernels, traced patterns, stage outputs): whole or
not at all, and checked when read."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file beside it and a rename: a reader (another
    process, a TP rank) sees the whole file or none, and a failed write leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class BadEntry(Exception):
    """An entry that must not be loaded (corrupt, truncated, another format or key)."""


def write_entry(path: Path, fmt: int, key: str, body: str, field: str = "body") -> None:
    """A JSON cache entry: its format, the full key text, `body` under `field` and the body's
    sha256, written through `write_atomic`."""
    write_atomic(path, json.dumps({"format": fmt, "key": key, field: body,
                                   "sha256": hashlib.sha256(body.encode()).hexdigest()}).encode())


def read_entry(path: Path, fmt: int, key: str, field: str = "body") -> str:
    """The body of a whole entry `write_entry` wrote for this format and key; BadEntry for
    anything else (unreadable, another format or key, a checksum that fails)."""
    try:
        entry = json.loads(path.read_text())
    except ValueError as e:
        raise BadEntry(f"unreadable ({e})") from None
    if not isinstance(entry, dict) or entry.get("format") != fmt:
        raise BadEntry("another format")
    if entry.get("key") != key:
        raise BadEntry("made for another key")
    body = entry.get(field)
    if not isinstance(body, str) or hashlib.sha256(body.encode()).hexdigest() != entry.get("sha256"):
        raise BadEntry("checksum mismatch")
    return body
