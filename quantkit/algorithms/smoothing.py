"""Per-channel scale folding, shared by AWQ and SmoothQuant.

A mapping is a module `prev` whose output channels feed a set of Linear layers. Multiplying the Linears'
input columns by s and dividing prev's output channels by s leaves the float block unchanged, and moves
quantization difficulty between activations and weights. Which pairs are valid depends on what sits between
prev and the Linears, so mappings are found from the module structure and anything that cannot be verified
is skipped with a note, never guessed (the pairs follow AutoAWQ's awq/models/{llama,qwen3,opt}.py
`get_layers_for_scaling` and llm-compressor's AWQ mappings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Norms computing weight * normalize(x) (+ bias): dividing weight and bias by s divides the output by s.
# Gemma's (1 + weight) RMSNorm is not of this form and is deliberately absent.
_LINEAR_NORMS = {"LayerNorm", "RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_LLAMA_LIKE = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_LLAMA_NORMS = {"input_layernorm", "post_attention_layernorm"}
_QK_NORMS = {"q_norm", "k_norm"}  # Qwen3: act on queries and keys only, so v -> o stays exact


@dataclass
class Mapping:
    prev: nn.Module  # a norm or a Linear whose output channels are the linears' input channels
    prev_name: str
    linears: list[nn.Linear]
    names: list[str]
    inspect: nn.Module  # whose output measures the error: self_attn for q/k/v, mlp for gate/up, else the linear
    inspect_name: str


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _norm_problem(norm: nn.Module | None, linears: list[nn.Linear]) -> str | None:
    if norm is None:
        return "not found"
    if type(norm).__name__ not in _LINEAR_NORMS:
        return f"{type(norm).__name__} is not known to compute weight * normalize(x) + bias"
    weight = getattr(norm, "weight", None)
    if weight is None:
        return "has no affine weight to fold into"
    if any(lin.in_features != weight.numel() for lin in linears):
        return "width does not match the Linear inputs"
    return None


def find_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """The foldable (prev -> linears) pairs of one decoder block, and a note for each pair skipped.

    Llama / Mistral / Qwen2 / Qwen3: input_layernorm -> q,k,v; v_proj -> o_proj; post_attention_layernorm
    -> gate,up; up_proj -> down_proj. OPT: self_attn_layer_norm -> q,k,v; v_proj -> out_proj;
    final_layer_norm -> fc1; fc1 -> fc2. Other block classes with the same module names get the same
    pairs where the checks below hold, plus a note that the architecture is not a known one.
    """
    cls = type(block).__name__
    mappings: list[Mapping] = []
    notes: list[str] = []

    def linears(names: list[str]) -> list[nn.Linear] | None:
        mods = [_get(block, n) for n in names]
        return mods if all(isinstance(m, nn.Linear) for m in mods) else None

    def norm_pair(norm_name: str, names: list[str], inspect_name: str, placement: str | None) -> None:
        lins = linears(names)
        if lins is None:
            notes.append(f"{norm_name} -> {','.join(names)}: skipped, Linear layers not found")
            return
        norm = _get(block, norm_name)
        problem = placement or _norm_problem(norm, lins)
        if problem:
            notes.append(f"{norm_name} -> {','.join(names)}: skipped, {norm_name} {problem}")
            return
        mappings.append(Mapping(norm, norm_name, lins, names, _get(block, inspect_name), inspect_name))

    def linear_pair(prev_name: str, name: str, problem: str | None = None) -> None:
        prev, lin = _get(block, prev_name), _get(block, name)
        if not (isinstance(prev, nn.Linear) and isinstance(lin, nn.Linear)):
            notes.append(f"{prev_name} -> {name}: skipped, Linear layers not found")
        elif prev.out_features != lin.in_features:
            # GQA: v_proj has fewer outputs than o_proj has inputs (llm-awq PR #67)
            notes.append(f"{prev_name} -> {name}: skipped, {prev_name}.out_features {prev.out_features} != "
                         f"{name}.in_features {lin.in_features}")
        elif problem:
            notes.append(f"{prev_name} -> {name}: skipped, {problem}")
        else:
            mappings.append(Mapping(prev, prev_name, [lin], [name], lin, name))

    def attention_problem() -> str | None:
        # o_proj reads softmax(qk)·v per head: exact under v scaling unless something else acts on v
        attn = _get(block, "self_attn")
        extra = sorted(n for n, m in attn.named_modules() if n and "norm" in type(m).__name__.lower()
                       and n not in _QK_NORMS)
        return f"self_attn has {', '.join(extra)} that may act on v" if extra else None

    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    if _get(block, "self_attn.o_proj") is not None:  # Llama family
        # sandwich norms (Gemma2/3, Olmo2) change where post_attention_layernorm sits
        others = sorted(n for n, m in block.named_children() if "norm" in n and n not in _LLAMA_NORMS)
        placement = f"placement unclear: block also has {', '.join(others)}" if others else None
        norm_pair("input_layernorm", qkv, "self_attn", placement)
        linear_pair("self_attn.v_proj", "self_attn.o_proj", attention_problem())
        norm_pair("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp", placement)
        # down_proj reads act(gate(x)) * up(x): linear in each up_proj output channel (not so without a gate)
        ungated = "mlp has no gate_proj: down_proj reads act(up(x))"
        linear_pair("mlp.up_proj", "mlp.down_proj", None if _get(block, "mlp.gate_proj") is not None else ungated)
        known = cls in _LLAMA_LIKE
    elif _get(block, "self_attn.out_proj") is not None and _get(block, "fc1") is not None:  # OPT
        # OPT-350m normalizes after attention / the MLP (do_layer_norm_before=False): no norm feeds the Linears
        placement = None if getattr(block, "do_layer_norm_before", False) else "is applied after, not before"
        norm_pair("self_attn_layer_norm", qkv, "self_attn", placement)
        linear_pair("self_attn.v_proj", "self_attn.out_proj", attention_problem())
        norm_pair("final_layer_norm", ["fc1"], "fc1", placement)
        # relu(x / s) = relu(x) / s for s > 0; GELU and friends are not positively homogeneous
        act = getattr(block, "activation_fn", None)
        linear_pair("fc1", "fc2", None if isinstance(act, nn.ReLU) else f"activation {type(act).__name__} is not ReLU")
        known = cls == "OPTDecoderLayer"
    else:
        return [], [f"{cls}: no known AWQ mapping structure (expected Llama- or OPT-style module names)"]
    if not known:
        notes.append(f"{cls}: not a known architecture; mappings were derived from module names")
    return mappings, notes


@torch.no_grad()
def fold(mapping: Mapping, s: torch.Tensor) -> None:
    """In place: each linear's weight columns times s, prev's output channels divided by s (a norm's
    weight and bias, or a prev Linear's weight rows and bias). The float block function is unchanged.
    Computed in float32 and rounded once to each parameter's dtype."""
    s = s.detach().float().flatten()
    if not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
        raise ValueError("fold: scales must be positive and finite")
    prev = mapping.prev
    width = prev.out_features if isinstance(prev, nn.Linear) else prev.weight.numel()
    if s.numel() != width or any(lin.in_features != width for lin in mapping.linears):
        raise ValueError(f"fold: {s.numel()} scales for {mapping.prev_name} ({width} channels)")

    def update(p: torch.Tensor, value: torch.Tensor) -> None:
        p.copy_(value.to(p.dtype))

    for lin in mapping.linears:
        update(lin.weight, lin.weight.float() * s.to(lin.weight.device))
    s = s.to(prev.weight.device)
    update(prev.weight, prev.weight.float() / (s[:, None] if isinstance(prev, nn.Linear) else s))
    if getattr(prev, "bias", None) is not None:
        update(prev.bias, prev.bias.float() / s)
