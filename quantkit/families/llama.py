"""Llama-style decoders (Llama, Mistral, Qwen2, Qwen3), and the Llama-style parts other families reuse.

A block normalizes before attention (input_layernorm -> q,k,v) and before the MLP (post_attention_layernorm ->
gate,up); v_proj -> o_proj and up_proj -> down_proj fold too (the pairs follow AutoAWQ's awq/models/{llama,qwen3}.py
`get_layers_for_scaling` and llm-compressor's AWQ mappings).
"""

from __future__ import annotations

from collections.abc import Sequence

from .family import Family, Pairs, register
from .moe import Experts

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def attention(p: Pairs, norm: str | None, first: Sequence[str] = QKV, placement: str | None = None) -> None:
    """norm -> the Linears reading the attention input (`first`), scored on self_attn's output; v_proj -> o_proj
    where v is a Linear of its own (skipped under GQA: the shapes differ)."""
    if norm is None:
        p.notes.append(f"{','.join(first)}: no norm before them (the block normalizes after attention)")
    else:
        p.norm(norm, first, "self_attn", placement)
    if p.has("self_attn.v_proj"):
        p.linear("self_attn.v_proj", "self_attn.o_proj", p.attention_problem())


def mlp(p: Pairs, norm: str | None, placement: str | None = None, shared: tuple[str, ...] = ()) -> None:
    """norm -> the Linears reading the MLP input, scored on the MLP's output; up_proj -> down_proj. An MoE MLP
    (moe.Experts under mlp): the routers, every expert's gate,up and the `shared` experts' gate,up read the norm;
    up -> down per expert and per shared expert."""
    if not p.has("mlp"):
        p.notes.append("mlp: not found")
        return
    experts = next((m for m in p.get("mlp").children() if isinstance(m, Experts)), None)
    gates: list[str] = []  # the Linears reading the MLP input
    if experts is not None:
        # the router reads every token first, so it observes the norm's output (see Mapping.observe)
        gates += [f"mlp.{n}" for n in p.routers if p.has(f"mlp.{n}")]
        for e in range(len(experts)):
            gates += [f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"]
            # down_proj reads act(gate(x)) * up(x): linear in each up_proj output channel
            p.linear(f"mlp.experts.{e}.up_proj", f"mlp.experts.{e}.down_proj")
        for name in shared:
            if p.has(f"mlp.{name}"):
                gates += [f"mlp.{name}.gate_proj", f"mlp.{name}.up_proj"]
                p.linear(f"mlp.{name}.up_proj", f"mlp.{name}.down_proj")
    else:
        gates = ["mlp.gate_proj", "mlp.up_proj"]
        ungated = "mlp has no gate_proj: down_proj reads act(up(x))"
        p.linear("mlp.up_proj", "mlp.down_proj", None if p.has("mlp.gate_proj") else ungated)
    feed(p, norm, gates, placement)


def feed(p: Pairs, norm: str | None, gates: list[str], placement: str | None = None) -> None:
    """norm -> the Linears reading the MLP input, or the note that the block normalizes after the MLP."""
    if norm is None:
        p.notes.append(f"{','.join(gates[:2])}: no norm before them (the block normalizes after the MLP)")
    else:
        p.norm(norm, gates, "mlp", placement)


def llama_style(p: Pairs) -> None:
    attention(p, "input_layernorm")
    mlp(p, "post_attention_layernorm")


LLAMA = register(Family(name="Llama", model_types=("llama",), blocks=("LlamaDecoderLayer",), norms=("LlamaRMSNorm",),
                        mappings=llama_style))
MISTRAL = register(Family(name="Mistral", model_types=("mistral",), blocks=("MistralDecoderLayer",),
                          norms=("MistralRMSNorm",), mappings=llama_style))
QWEN2 = register(Family(name="Qwen2", model_types=("qwen2",), blocks=("Qwen2DecoderLayer",), norms=("Qwen2RMSNorm",),
                        mappings=llama_style))
# q_norm / k_norm normalize each head's queries and keys: v -> o stays exact
QWEN3 = register(Family(name="Qwen3", model_types=("qwen3",), blocks=("Qwen3DecoderLayer",), norms=("Qwen3RMSNorm",),
                        qk_norms=("q_norm", "k_norm"), mappings=llama_style))
