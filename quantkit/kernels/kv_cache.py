"""FP8 (e4m3) KV cache: what vLLM does to keys and values as it writes them into an fp8 cache, in plain torch.

A key / value state x [batch, kv_heads, seq, head_dim], after RoPE, becomes e4m3(clamp(x / s, ±448)) · s, with s
one float32 scale per tensor ([1]) or per KV head ([kv_heads, 1, 1], compressed-tensors' `attn_head`). The scales
are the checkpoint's `<attention>.k_scale` / `.v_scale` (compressed-tensors' names and shapes).

The states are met where the attention hands them to its cache (`Cache.update`): a forward pre-hook on the attention
module puts a stand-in cache in its cache argument that passes the states through a function, then on to the real
cache if there is one (compressed-tensors' QuantizedKVCache does the same for calibration). The calibration observer
(quantize/observers.py) and the runtime's quantize-dequantize both go through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from ..algorithms.fp8 import FP8_DTYPE, FP8_MAX

_CACHE_ARGS = ("cache", "past_key_values", "past_key_value")  # transformers 5.25 renamed past_key_values to cache
KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def cache_arg(module: nn.Module) -> str | None:
    """The name of the argument an attention module's forward takes its KV cache in, None for any other module."""
    if not all(hasattr(module, p) for p in ("k_proj", "v_proj")):
        return None
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((a for a in _CACHE_ARGS if a in params), None)


def attention_modules(root: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The attention modules under root that write a KV cache, by full name (prefix + name inside root)."""
    return {f"{prefix}{n}": m for n, m in root.named_modules() if cache_arg(m) is not None}


def scale_shape(strategy: str, kv_heads: int) -> list[int]:
    return [1] if strategy == "tensor" else [kv_heads, 1, 1]


def amax(x: torch.Tensor, strategy: str) -> torch.Tensor:
    """max |x| of a state [batch, kv_heads, seq, head_dim], float32, in the scale's shape. Exact in any dtype, and a
    max, so any split of the windows (micro-batches, ranks, resumed runs) gives the same bits."""
    a = x.detach().abs()
    a = a.amax() if strategy == "tensor" else a.amax(dim=(0, 2, 3))
    return a.float().reshape(scale_shape(strategy, x.shape[1])).cpu()


def scale_of(amax_: torch.Tensor) -> torch.Tensor:
    """amax / 448 in float32 (calculate_qparams' max / (range / 2)); a zero amax gets the smallest normal float32,
    as compressed-tensors replaces a zero scale with its dtype's eps, so x / s never divides by zero."""
    s = amax_.float() / FP8_MAX
    return torch.where(s == 0, torch.finfo(torch.float32).tiny, s)


def qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x through an e4m3 cache with this scale, in x's dtype; computed in float32 as vLLM's cache write does."""
    scale = scale.to(x.device)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


class _Cache:
    """Stands in for the attention's cache during one call: states go through fn, then to the real cache."""

    def __init__(self, fn: KV, cache):
        self.fn, self.cache = fn, cache

    def update(self, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        key, value = self.fn(key, value)
        return (key, value) if self.cache is None else self.cache.update(key, value, *args, **kwargs)

    def __getattr__(self, name: str):  # anything else the attention asks of its cache (sequence length...)
        if name == "cache" or self.cache is None:
            raise AttributeError(name)
        return getattr(self.cache, name)


def on_states(module: nn.Module, fn: KV) -> torch.utils.hooks.RemovableHandle:
    """fn(key, value) -> (key, value) on every state `module` (an attention module) writes to its cache."""
    arg = cache_arg(module)

    def hook(_, args, kwargs):
        kwargs[arg] = _Cache(fn, kwargs.get(arg))
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def apply_fp8_kv(model: nn.Module, scales: dict[str, torch.Tensor]) -> list:
    """Every attention module with `<name>.k_scale` and `.v_scale` in scales quantize-dequantizes its states
    through e4m3 with them; returns the hooks' handles."""
    handles = []
    for name, module in attention_modules(model).items():
        k, v = scales[f"{name}.k_scale"].float(), scales[f"{name}.v_scale"].float()
        handles.append(on_states(module, lambda key, value, k=k, v=v: (qdq(key, k), qdq(value, v))))
    return handles


def expected_scales(model: nn.Module, strategy: str) -> dict[str, list[int]]:
    """The k / v scales a checkpoint of `model` with an FP8 KV cache of this compressed-tensors strategy (tensor |
    attn_head) stores, by name, with their shapes."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    shape = scale_shape("tensor" if strategy == "tensor" else "head", heads)
    return {f"{name}.{kind}_scale": shape for name in attention_modules(model) for kind in ("k", "v")}
