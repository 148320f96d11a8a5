"""Writes that never leave a half-written file (a temp file next to the target, then an atomic rename), where
quantkit's caches live, and what a model's weights weigh."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path | str, write: Callable[[Path], None]) -> Path:
    """write(temp path) fills a temp file next to `path`, which then replaces it; a failed write leaves no file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: Path | str, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: Path | str, body: dict, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(body, indent=indent) + "\n")


def cache_root(override: str | None = None) -> Path:
    """--cache-dir, else $QUANTKIT_CACHE, else ~/.cache/quantkit."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("QUANTKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"


def weight_bytes(path: str | Path, model=None) -> tuple[int, str]:
    """The bytes of a model's weights: its safetensors files, else (a GGUF file, a hub id) its parameters in memory,
    tied ones once; with where the number comes from."""
    files = list(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if files or model is None:
        return sum(f.stat().st_size for f in files), "safetensors files"
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values()), "parameters in memory"


def write_json(path: str | None, body: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, body)
