"""DeepSeek-V3: multi-head latent attention (MLA) and an MoE MLP with shared experts; the first
first_k_dense_replace layers keep a dense MLP.

MLA projects queries through a low rank (q_a_proj, q_a_layernorm, q_b_proj; or one plain q_proj) and keys / values
through kv_a_proj_with_mqa, whose compressed part kv_a_layernorm normalizes for kv_b_proj.
"""

from __future__ import annotations

from .family import Family, Pairs, register
from .llama import attention, mlp


def latent_attention(p: Pairs, norm: str | None, placement: str | None = None) -> None:
    """input norm -> q_a_proj (or q_proj), kv_a_proj_with_mqa; q_a_layernorm -> q_b_proj; kv_a_layernorm ->
    kv_b_proj. v -> o cannot fold: v is a slice of kv_b_proj's per-head outputs."""
    q = "self_attn.q_a_proj" if p.has("self_attn.q_a_proj") else "self_attn.q_proj"
    if p.has("self_attn.q_b_proj"):
        p.norm("self_attn.q_a_layernorm", ["self_attn.q_b_proj"], "self_attn.q_b_proj")
    # kv_a_layernorm normalizes the compressed kv part of kv_a_proj's output; kv_b_proj reads exactly that
    p.norm("self_attn.kv_a_layernorm", ["self_attn.kv_b_proj"], "self_attn.kv_b_proj")
    p.notes.append("self_attn.kv_b_proj -> self_attn.o_proj: skipped, v is a slice of kv_b_proj's per-head outputs")
    attention(p, norm, [q, "self_attn.kv_a_proj_with_mqa"], placement)


def deepseek_v3(p: Pairs) -> None:
    latent_attention(p, "input_layernorm")
    mlp(p, "post_attention_layernorm", shared=("shared_experts",))


# the MLA norms sit on the low-rank q / kv paths, each with its own pair: not on v
DEEPSEEK_V3 = register(Family(name="DeepSeek-V3", model_types=("deepseek_v3",), blocks=("DeepseekV3DecoderLayer",),
                              norms=("DeepseekV3RMSNorm",), qk_norms=("q_a_layernorm", "kv_a_layernorm"),
                              routers=("gate",), mappings=deepseek_v3))
