"""Mixtral and OLMoE: Llama-style attention (OLMoE with q_norm / k_norm), a router (`gate`) and routed experts, no
shared expert. Mixtral's checkpoint names its experts block_sparse_moe.experts.E.w1 / w2 / w3: moe.checkpoint_names
finds them through transformers' conversion."""

from __future__ import annotations

from .family import Family, register
from .llama import llama_style

MIXTRAL = register(Family(name="Mixtral", model_types=("mixtral",), blocks=("MixtralDecoderLayer",),
                          norms=("MixtralRMSNorm",), routers=("gate",), mappings=llama_style))
OLMOE = register(Family(name="OLMoE", model_types=("olmoe",), blocks=("OlmoeDecoderLayer",), norms=("OlmoeRMSNorm",),
                        qk_norms=("q_norm", "k_norm"), routers=("gate",), mappings=llama_style))
