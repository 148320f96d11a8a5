"""OLMo 2: normalizes after attention and after the MLP (post_attention_layernorm, post_feedforward_layernorm), so
no norm feeds a Linear; only v -> o (without GQA) and up -> down fold, and SmoothQuant has nothing to smooth."""

from __future__ import annotations

from .family import Family, Pairs, register
from .llama import attention, mlp


def olmo2(p: Pairs) -> None:
    attention(p, None)
    mlp(p, None)


OLMO2 = register(Family(name="OLMo 2", model_types=("olmo2",), blocks=("Olmo2DecoderLayer",), norms=("Olmo2RMSNorm",),
                        qk_norms=("q_norm", "k_norm"), mappings=olmo2))
