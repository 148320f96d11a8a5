"""Writes that never leave a half-written file: a temp file next to the target, then an atomic rename."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(path: Path | str, text: str) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: Path | str, body: dict, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(body, indent=indent) + "\n")
