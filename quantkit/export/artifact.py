"""Write one artifact folder: sharded safetensors (+ index), config.json with the format's
quantization_config, tokenizer, generation config and the quantkit.json manifest.

Tensors arrive one by one in the model's state_dict order (`stored_keys`), a quantized Linear's packed
tensors in place of its weight, so the in-memory path (the whole model at the end) and the streamed path
(block by block as each is quantized) cut the same shards and write byte-identical files. A shard's tensors are
spooled to disk as they arrive and the shard is written when it is full (`export.max_shard_size`); the shard names
and the index are written last, when the count is known.

Everything is written to a hidden temp folder next to the destination and renamed into place only
when complete, so an interrupted run leaves nothing that looks like a finished artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..errors import QuantkitError
from ..untrusted import check_finite
from ..algorithms.scheme import QuantizedTensor
from . import formats
from .base import QuantInfo

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "quantkit.json"


def stored_keys(model: nn.Module) -> list[str]:
    """The model's state_dict keys as a checkpoint stores them: tied duplicates dropped (lm_head <- embed_tokens;
    safetensors forbids shared storage). Works on a meta-device skeleton too: ties are the same Parameter."""
    seen: set[int] = set()
    keys = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            keys.append(name)
        seen.add(id(t))
    return keys


class ShardWriter:
    """Greedy sharding in arrival order: a tensor that would take the current shard past max_bytes opens the next.
    A tensor's bytes go to the shard's spool file as it arrives, so no shard is held in memory; closing a shard
    writes the safetensors file from the spool (`_SpooledShard`)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.shard: _SpooledShard | None = None
        self.files: list[Path] = []  # saved shards, under temporary names until close()
        self.weight_map: dict[str, int] = {}  # tensor name -> shard number
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.shard is not None and self.shard.size + nbytes > self.max_bytes:
            self._flush()
        if self.shard is None:
            self.shard = _SpooledShard(self.folder / f".shard-{len(self.files):05d}.spool")
        self.shard.add(name, t)
        self.weight_map[name] = len(self.files)
        self.total += nbytes

    def _flush(self) -> None:
        path = self.folder / f".shard-{len(self.files):05d}.safetensors"
        (self.shard or _SpooledShard(path.with_suffix(".spool"))).save(path, {"format": "pt"})
        self.files.append(path)
        self.shard = None

    def abort(self) -> None:
        if self.shard is not None:
            self.shard.file.close()
            self.shard = None

    def close(self) -> list[str]:
        if self.shard is not None or not self.files:
            self._flush()
        if len(self.files) == 1:
            self.files[0].rename(self.folder / WEIGHTS_NAME)
            return [WEIGHTS_NAME]
        names = [f"model-{i:05d}-of-{len(self.files):05d}.safetensors" for i in range(1, len(self.files) + 1)]
        for path, name in zip(self.files, names):
            path.rename(self.folder / name)
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {k: names[i] for k, i in self.weight_map.items()}}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names + [INDEX_NAME]


class _SpooledShard:
    """One safetensors file written from a spool: tensors' raw bytes are appended as they arrive; `save` writes the
    header and then the bytes in the order safetensors stores them, the same file `save_file` writes (tested). The
    order (by dtype, then name) is safetensors' own, read from the header it writes for one-element stand-ins."""

    def __init__(self, spool: Path):
        self.spool = spool
        self.file = open(spool, "wb")
        self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}  # name -> dtype, shape, offset, bytes
        self.size = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        self.file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.entries[name] = (t.dtype, list(t.shape), self.size, nbytes)
        self.size += nbytes

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        from safetensors.torch import save

        self.file.close()
        stand_ins = _header(save({k: torch.zeros(1, dtype=dtype) for k, (dtype, *_) in self.entries.items()}))
        order = [k for k in stand_ins if k != "__metadata__"]
        header, start = {"__metadata__": metadata}, 0
        for k in order:
            _, shape, _, nbytes = self.entries[k]
            header[k] = {"dtype": stand_ins[k]["dtype"], "shape": shape, "data_offsets": [start, start + nbytes]}
            start += nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        with open(self.spool, "rb") as src, open(path, "wb") as out:
            out.write(len(text).to_bytes(8, "little") + text)
            for k in order:
                _, _, offset, nbytes = self.entries[k]
                src.seek(offset)
                while nbytes:
                    chunk = src.read(min(nbytes, 1 << 24))
                    out.write(chunk)
                    nbytes -= len(chunk)
        self.spool.unlink()


def _header(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    shards = ShardWriter(folder, max_bytes)
    for name, t in tensors.items():
        shards.add(name, t)
    return shards.close()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ArtifactWriter:
    """One artifact folder, filled tensor by tensor in `stored_keys` order; `finish` writes the rest and renames it
    into place. Used as a context manager: on any error the temp folder goes and an OSError (disk full,
    permissions) becomes one line naming the destination."""

    def __init__(self, dest: Path, fmt: str, info: QuantInfo, dtype: torch.dtype, max_shard_bytes: int,
                 overwrite: bool = False, names=None):
        """names: model key -> the original checkpoint's key (moe.CheckpointNames; None: the model's own names)."""
        self.names = names or (lambda key: key)
        self.dest, self.fmt, self.format, self.dtype = Path(dest), fmt, formats.get(fmt), dtype
        self.info = info if names is None else replace(
            info, unquantized_linears=[names.module(n) for n in info.unquantized_linears],
            overrides={names.module(n): spec for n, spec in info.overrides.items()},
            linears=[names.module(n) for n in info.linears])
        if self.dest.exists() and not overwrite:
            raise QuantkitError(f"export.output: {self.dest} already exists (pass --overwrite to replace it)")
        self.tmp = self.dest.parent / f".{self.dest.name}.partial-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            self.tmp.mkdir(parents=True)
        except OSError as err:  # a read-only file system, a file where a folder should be
            raise QuantkitError(f"export.output: cannot write {self.dest}: {err.strerror or err}") from None
        self.shards = ShardWriter(self.tmp, max_shard_bytes)

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is None:
            return
        self.shards.abort()  # an open spool would keep its deleted file's disk space
        shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise QuantkitError(f"export.output: cannot write {self.dest}: {err.strerror or err}") from None

    def add(self, name: str, t: torch.Tensor, qweights: dict[str, QuantizedTensor]) -> None:
        """A state_dict entry: a quantized Linear's weight becomes its packed tensors, any other float is cast to
        the export dtype."""
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in qweights:
            for key, packed in self.format.encode({module: qweights[module]}, self.info, self.dtype).tensors.items():
                check_finite(self.names(key), packed)
                self.shards.add(self.names(key), packed)
        else:
            t = t.to(self.dtype) if t.is_floating_point() else t
            check_finite(self.names(name), t)  # an embedding, norm or head: no Linear check saw it
            self.shards.add(self.names(name), t)

    def add_extra(self, tensors: dict[str, torch.Tensor]) -> None:
        """Tensors of no Linear (the KV cache's k / v scales), kept in their dtype, after the model's own: both
        paths add them last, so they cut the same shards."""
        for name, t in tensors.items():
            check_finite(self.names(name), t)
            self.shards.add(self.names(name), t)

    def finish(self, config, tokenizer, generation_config, manifest: dict) -> Path:
        """config: the model's PretrainedConfig; writes config.json with the format's quantization_config."""
        self.shards.close()
        encoded = self.format.encode({}, self.info, self.dtype)
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("auto_map", None)  # a pointer to custom code: an artifact never carries one on
        cfg["dtype"] = str(self.dtype).removeprefix("torch.")
        cfg["quantization_config"] = encoded.quantization_config
        (self.tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name, body in encoded.extra_files.items():
            (self.tmp / name).write_text(json.dumps(body, indent=2) + "\n")
        tokenizer.save_pretrained(str(self.tmp))
        if generation_config is not None:
            generation_config.save_pretrained(str(self.tmp))
        files = {p.name: sha256_file(p) for p in sorted(self.tmp.iterdir()) if p.is_file()}
        (self.tmp / MANIFEST_NAME).write_text(json.dumps(dict(manifest, format=self.fmt, files=files), indent=2) + "\n")
        old = self.dest.parent / f".{self.dest.name}.replaced-{os.getpid()}"
        if self.dest.exists():  # moved aside, not deleted, until the new folder is in place: never no artifact at all
            self.dest.rename(old)
        self.tmp.rename(self.dest)
        shutil.rmtree(old, ignore_errors=True)
        return self.dest


def write_artifact(
    dest: Path,
    fmt: str,
    model: nn.Module,
    tokenizer,
    qweights: dict[str, QuantizedTensor],
    info: QuantInfo,
    dtype: torch.dtype,
    max_shard_bytes: int,
    manifest: dict,
    overwrite: bool = False,
    names=None,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """The in-memory path: the whole quantized model written at once; extra: ArtifactWriter.add_extra's."""
    with ArtifactWriter(dest, fmt, info, dtype, max_shard_bytes, overwrite, names) as writer:
        state = model.state_dict()
        for name in stored_keys(model):
            writer.add(name, state[name], qweights)
        writer.add_extra(extra or {})
        return writer.finish(model.config, tokenizer, getattr(model, "generation_config", None), manifest)
