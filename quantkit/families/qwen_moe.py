"""Qwen3-MoE and Qwen2-MoE: Llama-style attention; the MLP norm feeds the router (`gate`), every expert's gate,up
and, on Qwen2-MoE, the shared expert's gate,up and its own gate (`shared_expert_gate`). Layers listed in
mlp_only_layers keep a dense MLP, folded as Llama's."""

from __future__ import annotations

from .family import Family, Pairs, register
from .llama import attention, llama_style, mlp


def qwen2_moe(p: Pairs) -> None:
    attention(p, "input_layernorm")
    mlp(p, "post_attention_layernorm", shared=("shared_expert",))


QWEN3_MOE = register(Family(name="Qwen3-MoE", model_types=("qwen3_moe",), blocks=("Qwen3MoeDecoderLayer",),
                            norms=("Qwen3MoeRMSNorm",), qk_norms=("q_norm", "k_norm"), routers=("gate",),
                            mappings=llama_style))
QWEN2_MOE = register(Family(name="Qwen2-MoE", model_types=("qwen2_moe",), blocks=("Qwen2MoeDecoderLayer",),
                            norms=("Qwen2MoeRMSNorm",), routers=("gate", "shared_expert_gate"), mappings=qwen2_moe))
