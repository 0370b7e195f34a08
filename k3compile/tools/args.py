"""Argument types the `k3compile` tools share: each bad value is one argparse error line (exit
status 2) before anything compiles, never a traceback."""

from __future__ import annotations

import argparse
import json
from typing import Any

from k3compile.settings import Options


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value JSON where it parses (`buckets=[1,2,4]`, `verify=true`), else a
    string (`executor=aten`); checked against the backend's options."""
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    try:
        Options.make({key: parsed})
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(_one_line(e, key, parsed)) from None
    return key, parsed


def _one_line(e: Exception, key: str, value: Any) -> str:
    if isinstance(e, ValueError) and str(e).startswith(("unknown", key)):
        return str(e).splitlines()[0]
    if key == "buckets":
        return f"buckets={value}: not a JSON list of positive batch sizes (e.g. buckets=[1,2,4])"
    return f"{key}={value}: not a valid value of option {key!r} ({str(e).splitlines()[0]})"
