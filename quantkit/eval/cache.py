"""On-disk cache of what the original model produced, so comparing N artifacts runs the original once.

An entry is a folder named by the sha256 of everything that determines its content (the base model's
files, the exact token ids, window length, top-k, dtype, device type, package versions). It is written
under a temporary name and renamed when complete, so an interrupted run leaves no half entry.
Logit entries hold one safetensors file per window (streamed in and out, never the whole set in memory);
task scores and generations are small JSON entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .distribution import BaseTopK

META = "meta.json"


def key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def tokens_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


class _Writer:
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


class LogitCache:
    def __init__(self, root: Path, entry_key: str):
        self.folder = root / "base-logits" / entry_key
        self._writer: _Writer | None = None

    def complete(self) -> bool:
        return (self.folder / META).is_file()

    def meta(self) -> dict:
        return json.loads((self.folder / META).read_text())

    def read(self, window: int) -> BaseTopK:
        t = load_file(str(self.folder / f"w{window:06d}.safetensors"))
        return BaseTopK(t["topk_logp"], t["topk_idx"], t["rest"], t["target_logp"])

    def start(self) -> None:
        self._writer = _Writer(self.folder)

    def write(self, window: int, base: BaseTopK) -> None:
        save_file({"topk_logp": base.topk_logp, "topk_idx": base.topk_idx, "rest": base.rest,
                   "target_logp": base.target_logp},
                  str(self._writer.tmp / f"w{window:06d}.safetensors"))

    def commit(self, meta: dict) -> None:
        self._writer.commit(meta)
        self._writer = None

    def abort(self) -> None:
        if self._writer:
            self._writer.abort()
            self._writer = None


class JsonCache:
    """Small results (task scores, generations) of the original, keyed the same way."""

    def __init__(self, root: Path, kind: str, entry_key: str):
        self.folder = root / kind / entry_key

    def get(self) -> dict | None:
        path = self.folder / META
        return json.loads(path.read_text())["value"] if path.is_file() else None

    def put(self, value: dict, parts: dict) -> None:
        writer = _Writer(self.folder)
        writer.commit({"value": value, "key_parts": parts})
