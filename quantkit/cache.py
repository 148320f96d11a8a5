"""On-disk cache of what an original model produced, so comparing N artifacts runs the original once.

An entry is a folder named by the sha256 of everything that determines its content (the base model's
files, the exact token ids, window length, top-k, dtype, device type, package versions). It is written
under a temporary name and renamed when complete, so an interrupted run leaves no half entry.
Logit entries (eval/compare.LogitCache) hold one safetensors file per window, streamed in and out; task scores,
generations and the `self` domain's text are small JSON entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

META = "meta.json"


def key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def tokens_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


class EntryWriter:
    """Folder written under a temporary name; `commit` renames it into place."""

    def __init__(self, final: Path):
        self.final = final
        self.tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)

    def commit(self, meta: dict) -> None:
        (self.tmp / META).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class JsonCache:
    """Small results (task scores, generations) of the original, keyed the same way."""

    def __init__(self, root: Path, kind: str, entry_key: str):
        self.folder = root / kind / entry_key

    def get(self) -> dict | None:
        path = self.folder / META
        return json.loads(path.read_text())["value"] if path.is_file() else None

    def put(self, value: dict, parts: dict) -> None:
        writer = EntryWriter(self.folder)
        writer.commit({"value": value, "key_parts": parts})
