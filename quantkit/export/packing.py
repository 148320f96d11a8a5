"""Dense little-endian bit packing into int32 words, the layout both GPTQ and compressed-tensors use.

Value k of a run along the packed dimension sits at bit `bits*k` of the stream formed by the words
w0 | w1<<32 | w2<<64 ...; for 2/4/8 bits no value crosses a word, for 3 bits 32 values fill 3 words
(AutoGPTQ's 3-bit layout is exactly this stream).
"""

from __future__ import annotations

import math

import torch

from ..algorithms.grid import row_steps

_MASK32 = 0xFFFFFFFF


def packed_length(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned integers (< 2**bits) along `dim` into int32 words."""
    v = values.movedim(dim, -1)
    lead, n = v.shape[:-1], v.shape[-1]
    rows = v.reshape(-1, n)
    words = torch.empty(rows.shape[0], packed_length(n, bits), dtype=torch.int32)
    for r in row_steps(*rows.shape):  # the int64 temporaries of a few rows at a time, not of the whole weight
        words[r] = _pack_rows(rows[r], bits)
    return words.reshape(*lead, -1).movedim(-1, dim).contiguous()


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    v = values.to(torch.int64)
    n = v.shape[-1]
    if 32 % bits == 0:  # no value crosses a word: each word is its values shifted into place, summed (disjoint bits)
        per = 32 // bits
        v = torch.nn.functional.pad(v, (0, (-n) % per)).reshape(*v.shape[:-1], -1, per)
        words = (v << (torch.arange(per) * bits)).sum(-1)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    v = torch.nn.functional.pad(v, (0, (-n) % 32)).reshape(*v.shape[:-1], -1, 32)
    words = torch.zeros(*v.shape[:-1], bits + 1, dtype=torch.int64)
    for k in range(32):
        word, offset = divmod(k * bits, 32)
        words[..., word] |= (v[..., k] << offset) & _MASK32
        if offset + bits > 32:
            words[..., word + 1] |= v[..., k] >> (32 - offset)
    words = words[..., :bits].reshape(*v.shape[:-2], -1)[..., : packed_length(n, bits)]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(words: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
    """Inverse of `pack`: the first n values along `dim`, as int64."""
    w = words.movedim(dim, -1).to(torch.int64) & _MASK32
    w = torch.nn.functional.pad(w, (0, (-w.shape[-1]) % bits + 1)).reshape(*w.shape[:-1], -1)
    blocks = (w.shape[-1] - 1) // bits
    mask = (1 << bits) - 1
    out = torch.empty(*w.shape[:-1], blocks, 32, dtype=torch.int64)
    base = torch.arange(blocks) * bits
    for k in range(32):
        word, offset = divmod(k * bits, 32)
        x = w[..., base + word] >> offset
        if offset + bits > 32:
            x = x | (w[..., base + word + 1] << (32 - offset))
        out[..., k] = x & mask
    return out.reshape(*w.shape[:-1], -1)[..., :n].movedim(-1, dim)
