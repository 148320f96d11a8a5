"""Load an artifact back into a plain torch model so eval measures exactly what ships.

Weight-only artifacts (gptq, awq, compressed-tensors pack-quantized): quantized Linear weights are unpacked
from the files and dequantized into ordinary nn.Linear weights, or, with `int4_device` (the bench), kept as
4-bit codes in W4Linear layers that run PyTorch's int4 kernels on that device. W8A8 artifacts (compressed-tensors
int-quantized / float-quantized) get Int8Linear / Fp8Linear layers, which quantize their inputs per token
as vLLM does, so eval measures quantized activations too. An artifact with an FP8 KV cache (compressed-tensors'
kv_cache_scheme, `*.k_scale` / `*.v_scale`) gets hooks that pass every key and value state through e4m3 with those
scales where the attention writes its cache (kernels/kv_cache.py), so eval, KLD, gates and the card measure it.
Plain HF folders and GGUF files load as originals.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import QuantkitError
from .algorithms.scheme import QuantizedTensor
from .export import formats
from .export.base import split_by_module
from .families import moe
from .kernels.kv_cache import apply_fp8_kv
from .kernels.w4a16 import pick_backend, supports, swap_w4a16_linears
from .kernels.w8a8 import swap_w8a8_linears
from .model import Loaded, load_model, quiet_transformers, torch_dtype
from .untrusted import SAFETENSORS_INDEX, check_config, weight_map

def _artifact_config(path: str | Path) -> dict | None:
    """A local folder's config.json, checked (untrusted.check_config), or None where there is none."""
    cfg = Path(path) / "config.json"
    return check_config(cfg) if cfg.is_file() else None


def _format_of(path: str | Path, raw: dict | None) -> str | None:
    method = ((raw or {}).get("quantization_config") or {}).get("quant_method")
    if method is not None and formats.find(method) is None:
        raise QuantkitError(f"{path}: quantization method '{method}' is not one quantkit reads "
                            f"({', '.join(formats.names())})")
    return method


def artifact_format(path: str | Path) -> str | None:
    """'gptq' / 'awq' / 'compressed-tensors' for a quantized folder (its quant_method), None for anything else."""
    return _format_of(path, _artifact_config(path))


def kv_cache_scheme(path: str | Path) -> dict | None:
    """An artifact's FP8 KV cache (compressed-tensors' kv_cache_scheme), None where the KV cache stays 16-bit."""
    kv = ((_artifact_config(path) or {}).get("quantization_config") or {}).get("kv_cache_scheme")
    return kv if isinstance(kv, dict) else None


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The files the index (or model.safetensors) names, each checked inside the folder with its header: a stray
    *.safetensors beside them is not part of the artifact."""
    file_of = weight_map(folder)
    if not file_of:
        raise QuantkitError(f"{folder}: no model.safetensors or {SAFETENSORS_INDEX}")
    files = [str(folder / f) for f in sorted(set(file_of.values()))]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
            raise QuantkitError(f"{f}: unreadable safetensors file ({err})") from None
    return tensors


def kv_scale(name: str) -> bool:
    return name.endswith((".k_scale", ".v_scale"))


def quantized_state_dict(
    folder: Path, fmt: str, qcfg: dict, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedTensor]]:
    """The artifact's unquantized tensors (floats cast to dtype) and its decoded quantized Linear weights."""
    codec = formats.get(fmt)
    tensors = read_tensors(folder)
    modules = split_by_module(tensors, codec.marker(qcfg))
    state = {}
    for name, t in tensors.items():
        prefix, _, _ = name.rpartition(".")
        if prefix in modules and not name.endswith(".bias"):
            continue
        # KV cache scales stay float32: amax / 448, which a 16-bit dtype would round
        state[name] = t.to(dtype) if t.is_floating_point() and not kv_scale(name) else t
    return state, {prefix: codec.decode_of(parts, qcfg, prefix) for prefix, parts in modules.items()}


def load(path: str, dtype: str = "auto", int4_device: torch.device | None = None, int4_backend: str = "auto") -> Loaded:
    """An artifact folder, an HF folder, a GGUF file or a hub id, as a torch model on CPU. With int4_device, 4-bit
    weight-only Linears become W4Linear layers (int4_backend: auto | torch | quantkit, see kernels/w4a16.py) whose
    buffers already live on that device (move the rest after)."""
    raw = _artifact_config(path)  # parsed and checked once
    fmt = _format_of(path, raw)
    if fmt is None:
        return load_model(path, dtype)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    quiet_transformers()

    folder = Path(path)
    weight_map(folder)  # the index and safetensors headers, before the skeleton
    raw = dict(raw)
    qcfg = raw.pop("quantization_config")
    stored = torch_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    want = stored if dtype == "auto" else torch_dtype(dtype)
    config = AutoConfig.for_model(**raw)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=want, trust_remote_code=False)
    ours = moe.prepare(model).inverse()  # per-expert Linears; the artifact keeps the original checkpoint's names
    state, qweights = quantized_state_dict(folder, fmt, qcfg, want)
    state = {ours(k): v for k, v in state.items()}
    kv_scales = {k: state.pop(k) for k in [k for k in state if kv_scale(k)]}
    qweights = {ours.module(k): v for k, v in qweights.items()}
    w8a8 = formats.get(fmt).activations(qcfg) is not None
    if w8a8:  # the quantized weights go into W8A8 layers below, not into the float Linears
        kept = qweights
    elif int4_device is not None and any(q.scheme.kind == "int" and q.scheme.bits == 4
                                         for q in qweights.values()):
        backend = pick_backend(int4_backend, int4_device)
        kept = {name: qw for name, qw in qweights.items() if supports(qw, int4_device, backend) is None}
    else:
        kept = {}
    state |= {f"{prefix}.weight": qw.dequantize(want) for prefix, qw in qweights.items() if prefix not in kept}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    missing = set(missing) - tied - {f"{prefix}.weight" for prefix in kept}
    if missing or unexpected:
        raise QuantkitError(
            f"{path}: tensors do not match the config (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    model.tie_weights()
    if qcfg.get("kv_cache_scheme"):
        try:
            apply_fp8_kv(model, kv_scales)
        except KeyError as err:
            raise QuantkitError(f"{path}: quantization_config has a kv_cache_scheme but no {err.args[0]}") from None
    if w8a8:
        swap_w8a8_linears(model, qweights, formats.get(fmt).input_group(qcfg))
    elif kept:
        swap_w4a16_linears(model, kept, int4_device, backend)
    model.eval()
    return Loaded(model, AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False), str(folder))
