"""Observers: statistics of the calibration forwards that become tensors of the artifact beside the Linears' (the FP8
KV cache's k / v scales), where a transform pass (transforms.py) rewrites weights and a weight stage rounds them.

The layer-wise loop (pipeline.py) attaches every observer to block i for the forward whose output feeds block i+1,
the quantized block's (so the keys and values are those the quantized model caches), closes the block after it (under
several processes the statistics are reduced across the ranks there, so a checkpoint saves final values), saves
`state()` in the block's checkpoint and `restore`s it on resume, and puts `tensors()` into the artifact. Every
statistic is a max, so micro-batches, offloaded batches, ranks and resumed runs give the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import QuantkitError
from ..kernels import kv_cache
from ..recipe import Recipe
from .distributed import Ranks


class KVCacheObserver:
    """max |key| and max |value| after RoPE, as each attention module hands them to its cache, per tensor or per KV
    head; the scales are amax / 448 (kv_cache.scale_of), llm-compressor's static min-max observer for e4m3."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # attention module -> (key, value) amax

    def attach(self, prefix: str, block: nn.Module) -> list:
        """prefix: the block's full name and a dot; returns the hooks' handles."""
        def observe(name: str):
            def fn(key: torch.Tensor, value: torch.Tensor):
                k, v = kv_cache.amax(key, self.strategy), kv_cache.amax(value, self.strategy)
                seen = self.amax.get(name)
                self.amax[name] = (k, v) if seen is None else (torch.maximum(seen[0], k), torch.maximum(seen[1], v))
                return key, value
            return fn

        modules = kv_cache.attention_modules(block, prefix)
        if not modules:
            raise QuantkitError(f"kv_cache: {prefix.rstrip('.')} has no attention module that writes a KV cache "
                                "(one with k_proj, v_proj and a cache argument)")
        return [kv_cache.on_states(m, observe(name)) for name, m in modules.items()]

    def close(self, prefix: str, ranks: Ranks) -> None:
        for name in sorted(n for n in self.amax if n.startswith(prefix)):
            for t in self.amax[name]:
                ranks.all_reduce(t, "max")

    def state(self) -> dict:
        # float32 values as JSON numbers: a float32 is a double exactly, and JSON writes doubles back exactly
        return {name: [k.tolist(), v.tolist()] for name, (k, v) in self.amax.items()}

    def restore(self, state: dict) -> None:
        self.amax = {name: (torch.tensor(k, dtype=torch.float32), torch.tensor(v, dtype=torch.float32))
                     for name, (k, v) in state.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{kind}_scale": kv_cache.scale_of(a) for name, (k, v) in sorted(self.amax.items())
                for kind, a in (("k", k), ("v", v))}


def build(recipe: Recipe) -> list[KVCacheObserver]:
    """The recipe's observers (none without kv_cache)."""
    return [] if recipe.kv_cache is None else [KVCacheObserver(recipe.kv_cache.strategy)]


def check_model(model: nn.Module, recipe: Recipe) -> None:
    """Before any weight is read: a kv_cache recipe needs attention modules that write a KV cache."""
    if recipe.kv_cache is not None and not kv_cache.attention_modules(model):
        raise QuantkitError(f"kv_cache: {type(model).__name__} has no attention module that writes a KV cache (one "
                            "with k_proj, v_proj and a cache argument)")
