"""Write one artifact folder: sharded safetensors (+ index), config.json with the format's
quantization_config, tokenizer, generation config and the quantkit.json manifest.

Everything is written to a hidden temp folder next to the destination and renamed into place only
when complete, so an interrupted run leaves nothing that looks like a finished artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import QuantkitError
from . import awq, compressed_tensors, gptq
from .base import Encoded, Fp8Weight, QuantInfo, QuantizedWeight

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "quantkit.json"


def encode(fmt: str, qweights: dict[str, QuantizedWeight | Fp8Weight], info: QuantInfo, dtype: torch.dtype) -> Encoded:
    if fmt == "gptq":
        if info.activations is not None:
            raise QuantkitError(f"export.formats: gptq stores weight-only quantization, not {info.activations} W8A8")
        return gptq.encode(qweights, info)
    if fmt == "awq":
        if info.activations is not None:
            raise QuantkitError(f"export.formats: awq stores weight-only quantization, not {info.activations} W8A8")
        return awq.encode(qweights, info)
    # compressed-tensors keeps int scales in the model's float dtype (FP8 scales stay float32); fp16-rounded values
    # are exact in float32 and float16 (bfloat16 would round them again, so those models get fp16 scales).
    return compressed_tensors.encode(qweights, info, torch.float32 if dtype == torch.float32 else torch.float16)


def float_state_dict(model: nn.Module, skip_modules: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors minus the quantized weights, tied duplicates dropped (safetensors forbids
    shared storage), floats cast to the export dtype."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in skip_modules:
            continue
        if t.data_ptr() in seen and t.numel() > 0:
            continue  # tied to an earlier tensor (lm_head <- embed_tokens)
        seen.add(t.data_ptr())
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    shards = _shards(tensors, max_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX_NAME]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_config_dict(model: nn.Module, dtype: torch.dtype, quantization_config: dict) -> dict:
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = quantization_config
    return cfg


def write_artifact(
    dest: Path,
    fmt: str,
    model: nn.Module,
    tokenizer,
    qweights: dict[str, QuantizedWeight | Fp8Weight],
    info: QuantInfo,
    dtype: torch.dtype,
    max_shard_bytes: int,
    manifest: dict,
    overwrite: bool = False,
) -> Path:
    dest = Path(dest)
    if dest.exists() and not overwrite:
        raise QuantkitError(f"export.output: {dest} already exists (pass --overwrite to replace it)")
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        encoded = encode(fmt, qweights, info, dtype)
        tensors = float_state_dict(model, set(qweights), dtype) | encoded.tensors
        write_safetensors(tmp, tensors, max_shard_bytes)
        config = model_config_dict(model, dtype, encoded.quantization_config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, body in encoded.extra_files.items():
            (tmp / name).write_text(json.dumps(body, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        body = dict(manifest, format=fmt, files=files)
        (tmp / MANIFEST_NAME).write_text(json.dumps(body, indent=2) + "\n")
        old = dest.parent / f".{dest.name}.replaced-{os.getpid()}"
        if dest.exists():  # moved aside, not deleted, until the new folder is in place: never no artifact at all
            dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:  # disk full, permissions: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise QuantkitError(f"export.output: cannot write {dest}: {err.strerror or err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
