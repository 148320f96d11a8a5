"""OPT: self_attn_layer_norm -> q,k,v; v_proj -> out_proj; final_layer_norm -> fc1; fc1 -> fc2 (AutoAWQ's
awq/models/opt.py)."""

from __future__ import annotations

from torch import nn

from .family import Family, Pairs, register
from .llama import QKV


def opt(p: Pairs) -> None:
    # OPT-350m normalizes after attention / the MLP (do_layer_norm_before=False): no norm feeds the Linears
    placement = None if getattr(p.block, "do_layer_norm_before", False) else "is applied after, not before"
    p.norm("self_attn_layer_norm", QKV, "self_attn", placement)
    p.linear("self_attn.v_proj", "self_attn.out_proj", p.attention_problem())
    p.norm("final_layer_norm", ["fc1"], "fc1", placement)
    # relu(x / s) = relu(x) / s for s > 0; GELU and friends are not positively homogeneous
    act = getattr(p.block, "activation_fn", None)
    p.linear("fc1", "fc2", None if isinstance(act, nn.ReLU) else f"activation {type(act).__name__} is not ReLU")


OPT = register(Family(name="OPT", model_types=("opt",), blocks=("OPTDecoderLayer",), norms=("LayerNorm",),
                      mappings=opt))
