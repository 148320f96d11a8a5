"""The fallback family: blocks no registered family claims get the pairs their module names suggest, where the same
checks hold (norm classes any family vouches for, widths, what sits between), plus a note that the architecture is
not a known one. Llama-style names (with Phi-3's fused or DeepSeek's latent attention, MoE experts) and OPT-style
names are recognized; anything else folds nothing."""

from __future__ import annotations

from .deepseek import latent_attention
from .family import Family, Pairs, register
from .llama import QKV, attention, mlp
from .opt import opt
from .phi3 import fused_gate_up, fused_qkv

STANDARD_NORMS = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"}
SANDWICH = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


def structural(p: Pairs) -> None:
    cls = type(p.block).__name__
    if p.has("self_attn.o_proj"):  # Llama-style names
        children = {n for n, _ in p.block.named_children()}
        attn_norm = "input_layernorm" if "input_layernorm" in children else None
        mlp_norm = "pre_feedforward_layernorm" if "pre_feedforward_layernorm" in children else (
            None if "post_feedforward_layernorm" in children else "post_attention_layernorm")
        unknown_norms = sorted(n for n in children if "norm" in n and n not in STANDARD_NORMS)
        placement = f"placement unclear: block also has {', '.join(unknown_norms)}" if unknown_norms else None
        if children & SANDWICH:
            placement = "placement unclear: sandwich norms in an unknown block"
        if p.has("self_attn.kv_a_proj_with_mqa"):
            latent_attention(p, attn_norm, placement)
        elif p.has("self_attn.qkv_proj"):
            fused_qkv(p, attn_norm, placement)
        else:
            attention(p, attn_norm, QKV, placement)
        if p.has("mlp.gate_up_proj"):
            fused_gate_up(p, mlp_norm, placement)
        else:
            mlp(p, mlp_norm, placement, shared=("shared_expert", "shared_experts"))
    elif p.has("self_attn.out_proj") and p.has("fc1"):  # OPT-style names
        opt(p)
    else:
        p.notes.append(f"{cls}: no known AWQ mapping structure (expected Llama- or OPT-style module names)")
        return
    p.notes.append(f"{cls}: not a known architecture; mappings were derived from module names")


# torch's nn.LayerNorm and nn.RMSNorm compute weight * normalize(x) (+ bias); `router` names an MoE router in
# architectures quantkit does not know by name
GENERIC = register(Family(name="", norms=("LayerNorm", "RMSNorm"), routers=("router",), mappings=structural),
                   fallback=True)
