"""Gemma 2 and Gemma 3: Llama-style attention, but RMSNorm computes (1 + weight) * normalize(x), so a fold divides
(1 + w), not w; and sandwich norms: pre_feedforward_layernorm, not post_attention_layernorm, feeds the MLP."""

from __future__ import annotations

from .family import Family, Pairs, register
from .llama import attention, mlp


def gemma(p: Pairs) -> None:
    attention(p, "input_layernorm")
    mlp(p, "pre_feedforward_layernorm")


# Gemma 1's GemmaRMSNorm too: its blocks fold through the structural fallback, with this norm rule.
# vLLM 0.32 `_FLOAT16_NOT_SUPPORTED_MODELS` (vllm/config/model.py): "Numerical instability"
GEMMA = register(Family(name="Gemma 2/3", model_types=("gemma2", "gemma3", "gemma3_text"),
                        blocks=("Gemma2DecoderLayer", "Gemma3DecoderLayer"),
                        offset_norms=("Gemma2RMSNorm", "Gemma3RMSNorm", "GemmaRMSNorm"), qk_norms=("q_norm", "k_norm"),
                        mappings=gemma, vllm_float16=False))
