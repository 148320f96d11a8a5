"""One timed generation: a prefill of the prompt, then greedy decode steps, each a single-token forward with the
KV cache, as a serving engine runs them. Also what one decode step must move and compute, for the roofline."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from torch import nn

from .peaks import sync


@dataclass
class Timing:
    prefill_s: float
    decode_s: float  # all gen_len decode steps


def make_cache(model: nn.Module, batch: int, max_len: int, static: bool):
    from transformers import DynamicCache, StaticCache

    if static:
        return StaticCache(config=model.config, max_cache_len=max_len)
    return DynamicCache(config=model.config)


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns, then goes)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def generate_timed(model: nn.Module, forward, prompt: torch.Tensor, gen_len: int, static: bool) -> Timing:
    """Greedy generation of gen_len tokens after `prompt` [batch, len]; `forward` is model.forward or its compiled
    version. Only the last position's logits are computed in the prefill (what engines do)."""
    batch, length = prompt.shape
    device = prompt.device
    kv = {cache_kwarg(model): make_cache(model, batch, length + gen_len, static)}
    sync(device)
    start = time.perf_counter()
    out = forward(input_ids=prompt, **kv, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(length, device=device))
    token = out.logits[:, -1:].argmax(-1)
    sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(gen_len):
        position = torch.tensor([length + step], device=device)
        out = forward(input_ids=token, **kv, use_cache=True, cache_position=position)
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    return Timing(prefill, time.perf_counter() - start)


def tensor_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and buffers (each storage once, so a tied head counts once):
    'total', and 'embedding' (the input embedding table, of which a decode step reads only one row per sequence
    unless the head shares it)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is not None and head.weight.data_ptr() == emb.data_ptr()
    return {"total": total, "embedding": 0 if tied else emb.untyped_storage().nbytes()}


def kv_cache_bytes(config, batch: int, length: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for `length` positions of `batch` sequences."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * length * batch * torch.empty((), dtype=dtype).element_size()


def decode_step_flops(model: nn.Module, batch: int, context: int) -> float:
    """2 · batch · (Linear weights) for the matmuls, plus 4 · batch · layers · heads · head_dim · context for
    attention scores and the weighted sum over the cache."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    linear = 0
    for m in model.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features"):
            linear += m.in_features * m.out_features
    attn = 4 * text.num_hidden_layers * text.num_attention_heads * head_dim * context
    return float(batch * (2 * linear + attn))
