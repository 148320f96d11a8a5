"""Phi-3: one fused qkv_proj and one fused gate_up_proj ([gate; up]) per block."""

from __future__ import annotations

from .family import Family, Pairs, register
from .llama import attention, feed


def fused_qkv(p: Pairs, norm: str | None, placement: str | None = None) -> None:
    """norm -> qkv_proj; v -> o cannot fold: v is a slice of qkv_proj's output."""
    p.notes.append("self_attn.qkv_proj -> self_attn.o_proj: skipped, v is a slice of the fused qkv_proj")
    attention(p, norm, ["self_attn.qkv_proj"], placement)


def fused_gate_up(p: Pairs, norm: str | None, placement: str | None = None) -> None:
    """norm -> gate_up_proj; its up half -> down_proj, which reads act(gate) * up."""
    inter = p.get("mlp.down_proj").in_features
    p.linear("mlp.gate_up_proj", "mlp.down_proj", rows=slice(inter, 2 * inter))
    feed(p, norm, ["mlp.gate_up_proj"], placement)


def phi3(p: Pairs) -> None:
    fused_qkv(p, "input_layernorm")
    fused_gate_up(p, "post_attention_layernorm")


PHI3 = register(Family(name="Phi-3", model_types=("phi3",), blocks=("Phi3DecoderLayer",), norms=("Phi3RMSNorm",),
                       mappings=phi3))
