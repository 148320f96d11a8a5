"""One timed generation: a prefill of the prompt, then greedy decode steps, each a single-token forward with the
KV cache, as a serving engine runs them. Also what one decode step must move and compute, for the roofline."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .peaks import sync


@dataclass
class Timing:
    prefill_s: float
    decode_s: float  # all gen_len decode steps


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns, then goes)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class EagerDecoder:
    """What `generate` does: a growing (dynamic) KV cache, one Python-dispatched forward per step."""

    variant = "eager"

    def __init__(self, model: nn.Module):
        self.model, self.kw = model, cache_kwarg(model)

    def prefill(self, prompt: torch.Tensor, max_len: int) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        length = prompt.shape[1]
        out = self.model(input_ids=prompt, **{self.kw: self.cache}, use_cache=True, logits_to_keep=1,
                         cache_position=torch.arange(length, device=prompt.device))
        return out.logits[:, -1:].argmax(-1)

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        pos = torch.tensor([position], device=token.device)
        out = self.model(input_ids=token, **{self.kw: self.cache}, use_cache=True, cache_position=pos)
        return out.logits[:, -1:].argmax(-1)


@contextmanager
def kept_write_positions(cache) -> Iterator[None]:
    """Forwards inside leave the cache's write positions as they were. transformers' static layers write at a
    position counter of their own (`cumulative_length`, advanced in place by each forward, whatever cache_position
    says): forwards that are not decode steps, such as the warm-ups before a CUDA graph capture, would move every
    later step's writes along, past the end of the cache."""
    counters = [layer.cumulative_length for layer in cache.layers
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    saved = [c.clone() for c in counters]
    try:
        yield
    finally:
        for c, v in zip(counters, saved):
            c.copy_(v)


class StaticDecoder(EagerDecoder):
    """A preallocated (static) KV cache so every decode step has the same shapes and addresses; the step is then
    captured once in a CUDA graph and replayed (GPU: no per-kernel launch cost), or compiled with torch.compile
    (CPU: fused kernels, no Python dispatch). One cache and graph per batch size, reused across repetitions."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.variant = "static+cudagraph" if next(model.parameters()).is_cuda else "static+compile"
        self.states: dict[tuple[int, int], dict] = {}
        self.compiled = None if self.variant == "static+cudagraph" else torch.compile(model.forward, dynamic=False)

    def prefill(self, prompt: torch.Tensor, max_len: int) -> torch.Tensor:
        from transformers import StaticCache

        batch, length = prompt.shape
        key = (batch, max_len)
        if key not in self.states:
            self.states[key] = {"cache": StaticCache(config=self.model.config, max_cache_len=max_len)}
        self.state = self.states[key]
        self.cache = self.state["cache"]
        self.cache.reset()
        out = self.model(input_ids=prompt, **{self.kw: self.cache}, use_cache=True, logits_to_keep=1,
                         cache_position=torch.arange(length, device=prompt.device))
        return out.logits[:, -1:].argmax(-1)

    def _forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        fn = self.compiled or self.model
        return fn(input_ids=token, **{self.kw: self.cache}, use_cache=True, cache_position=pos).logits

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        st = self.state
        if self.compiled is not None:
            return self._forward(token, torch.tensor([position], device=token.device))[:, -1:].argmax(-1)
        if "graph" not in st:  # capture on the first step; its own writes land at `position`, as the step's would
            st["token"], st["pos"] = token.clone(), torch.tensor([position], device=token.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), kept_write_positions(self.cache):  # warm-up off the capture stream
                for _ in range(2):  # (cuBLAS workspaces, lazy inits)
                    self._forward(st["token"], st["pos"])
            torch.cuda.current_stream().wait_stream(side)
            st["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(st["graph"]):
                st["logits"] = self._forward(st["token"], st["pos"])
        st["token"].copy_(token)
        st["pos"].fill_(position)
        st["graph"].replay()
        return st["logits"][:, -1:].argmax(-1)


@torch.inference_mode()
def generate_timed(decoder: EagerDecoder, prompt: torch.Tensor, gen_len: int) -> Timing:
    """Greedy generation of gen_len tokens after `prompt` [batch, len]. Only the last position's logits are
    computed in the prefill (what engines do)."""
    length = prompt.shape[1]
    device = prompt.device
    sync(device)
    start = time.perf_counter()
    token = decoder.prefill(prompt, length + gen_len)
    sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(gen_len):
        token = decoder.step(token, length + step)
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
