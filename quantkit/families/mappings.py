"""Which (prev -> Linears) pairs of a decoder block can fold a per-channel scale (AWQ, SmoothQuant).

Which pairs are valid depends on what sits between prev and the Linears, so mappings are found from the module
structure and anything that cannot be verified is skipped with a note, never guessed (the pairs follow AutoAWQ's
awq/models/{llama,qwen3,opt}.py `get_layers_for_scaling` and llm-compressor's AWQ mappings). Known block classes
come from the family tables; any other block with the same module names is matched structurally, with a note.
"""

from __future__ import annotations

from torch import nn

from ..algorithms.smoothing import Mapping
from . import KNOWN_BLOCKS, LINEAR_NORMS, OFFSET_NORMS, QK_NORMS, ROUTERS
from .moe import Experts


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _in_features(m: nn.Module) -> int:
    return m.weight.shape[1]


def _norm_problem(norm: nn.Module | None, linears: list[nn.Module]) -> str | None:
    if norm is None:
        return "not found"
    if type(norm).__name__ not in LINEAR_NORMS | OFFSET_NORMS:
        return f"{type(norm).__name__} is not known to compute weight * normalize(x) + bias"
    weight = getattr(norm, "weight", None)
    if weight is None:
        return "has no affine weight to fold into"
    if any(_in_features(lin) != weight.numel() for lin in linears):
        return "width does not match the Linear inputs"
    return None


def find_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """The foldable (prev -> linears) pairs of one decoder block, and a note for each pair skipped.

    Decoders with Llama-style names (Llama, Mistral, Qwen2/3, Granite, Phi-3, Gemma 2/3, OLMo 2, and the MoE
    families Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3):
      - the pre-attention norm (input_layernorm) -> q,k,v (Phi-3: qkv_proj; DeepSeek MLA: q_a_proj / q_proj and
        kv_a_proj_with_mqa); MLA also q_a_layernorm -> q_b_proj and kv_a_layernorm -> kv_b_proj;
      - v_proj -> o_proj (skipped under GQA, and for fused / low-rank v);
      - the pre-MLP norm (post_attention_layernorm; Gemma's pre_feedforward_layernorm) -> gate,up (Phi-3:
        gate_up_proj; MoE: the router, every expert's gate,up, the shared expert's gate,up and its gate);
      - up_proj -> down_proj, per expert and for the shared expert too (Phi-3: the up half of gate_up_proj).
      OLMo 2 normalizes after attention and after the MLP, so no norm feeds its Linears.
    OPT: self_attn_layer_norm -> q,k,v; v_proj -> out_proj; final_layer_norm -> fc1; fc1 -> fc2.
    Other block classes with the same module names get the same pairs where the checks below hold, plus a note that
    the architecture is not a known one.
    """
    cls = type(block).__name__
    mappings: list[Mapping] = []
    notes: list[str] = []

    def linears(names: list[str]) -> list[nn.Module] | None:
        mods = [_get(block, n) for n in names]
        ok = all(isinstance(m, nn.Linear) or (n.rpartition(".")[2] in ROUTERS and getattr(m, "weight", None)
                                              is not None) for n, m in zip(names, mods))
        return mods if ok and mods else None

    def norm_pair(norm_name: str, names: list[str], inspect_name: str, placement: str | None = None) -> None:
        lins = linears(names)
        if lins is None:
            notes.append(f"{norm_name} -> {','.join(names)}: skipped, Linear layers not found")
            return
        norm = _get(block, norm_name)
        problem = placement or _norm_problem(norm, lins)
        if problem:
            notes.append(f"{norm_name} -> {','.join(names)}: skipped, {norm_name} {problem}")
            return
        mappings.append(Mapping(norm, norm_name, lins, names, _get(block, inspect_name), inspect_name,
                                offset=type(norm).__name__ in OFFSET_NORMS))

    def linear_pair(prev_name: str, name: str, problem: str | None = None, rows: slice | None = None) -> None:
        prev, lin = _get(block, prev_name), _get(block, name)
        if not (isinstance(prev, nn.Linear) and isinstance(lin, nn.Linear)):
            notes.append(f"{prev_name} -> {name}: skipped, Linear layers not found")
            return
        width = prev.out_features if rows is None else len(range(prev.out_features)[rows])
        if width != lin.in_features:
            # GQA: v_proj has fewer outputs than o_proj has inputs (llm-awq PR #67)
            notes.append(f"{prev_name} -> {name}: skipped, {prev_name}.out_features {width} != "
                         f"{name}.in_features {lin.in_features}")
        elif problem:
            notes.append(f"{prev_name} -> {name}: skipped, {problem}")
        else:
            mappings.append(Mapping(prev, prev_name, [lin], [name], lin, name, rows))

    def attention_problem() -> str | None:
        # o_proj reads softmax(qk)·v per head: exact under v scaling unless something else acts on v
        attn = _get(block, "self_attn")
        extra = sorted(n for n, m in attn.named_modules() if n and "norm" in type(m).__name__.lower()
                       and n not in QK_NORMS)
        return f"self_attn has {', '.join(extra)} that may act on v" if extra else None

    if _get(block, "self_attn.o_proj") is not None:  # Llama-style names
        children = {n for n, _ in block.named_children()}
        attn_norm = "input_layernorm" if "input_layernorm" in children else None
        mlp_norm = "pre_feedforward_layernorm" if "pre_feedforward_layernorm" in children else (
            None if "post_feedforward_layernorm" in children else "post_attention_layernorm")
        known = cls in KNOWN_BLOCKS
        unknown_norms = sorted(n for n in children if "norm" in n and n not in {
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"})
        placement = f"placement unclear: block also has {', '.join(unknown_norms)}" if unknown_norms else None
        if not known and children & {"pre_feedforward_layernorm", "post_feedforward_layernorm"}:
            placement = "placement unclear: sandwich norms in an unknown block"
        _attention(block, attn_norm, placement, norm_pair, linear_pair, attention_problem, notes)
        _mlp(block, mlp_norm, placement, norm_pair, linear_pair, notes)
    elif _get(block, "self_attn.out_proj") is not None and _get(block, "fc1") is not None:  # OPT
        qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
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


def _attention(block, norm, placement, norm_pair, linear_pair, attention_problem, notes) -> None:
    has = lambda n: _get(block, n) is not None  # noqa: E731
    if has("self_attn.kv_a_proj_with_mqa"):  # DeepSeek MLA: low-rank q (or plain q_proj) and kv with their norms
        q = "self_attn.q_a_proj" if has("self_attn.q_a_proj") else "self_attn.q_proj"
        first = [q, "self_attn.kv_a_proj_with_mqa"]
        if has("self_attn.q_b_proj"):
            norm_pair("self_attn.q_a_layernorm", ["self_attn.q_b_proj"], "self_attn.q_b_proj")
        # kv_a_layernorm normalizes the compressed kv part of kv_a_proj's output; kv_b_proj reads exactly that
        norm_pair("self_attn.kv_a_layernorm", ["self_attn.kv_b_proj"], "self_attn.kv_b_proj")
        notes.append("self_attn.kv_b_proj -> self_attn.o_proj: skipped, v is a slice of kv_b_proj's per-head outputs")
    elif has("self_attn.qkv_proj"):  # Phi-3: one fused projection
        first = ["self_attn.qkv_proj"]
        notes.append("self_attn.qkv_proj -> self_attn.o_proj: skipped, v is a slice of the fused qkv_proj")
    else:
        first = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    if norm is None:
        notes.append(f"{','.join(first)}: no norm before them (the block normalizes after attention)")
    else:
        norm_pair(norm, first, "self_attn", placement)
    if has("self_attn.v_proj"):
        linear_pair("self_attn.v_proj", "self_attn.o_proj", attention_problem())


def _mlp(block, norm, placement, norm_pair, linear_pair, notes) -> None:
    mlp = _get(block, "mlp")
    if mlp is None:
        notes.append("mlp: not found")
        return
    experts = next((m for m in mlp.children() if isinstance(m, Experts)), None)
    gates: list[str] = []  # the Linears reading the MLP input
    if experts is not None:
        # the router reads every token first, so it observes the norm's output (see Mapping.observe)
        gates += [f"mlp.{n}" for n in ROUTERS if _get(mlp, n) is not None]
        for e in range(len(experts)):
            gates += [f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"]
            # down_proj reads act(gate(x)) * up(x): linear in each up_proj output channel
            linear_pair(f"mlp.experts.{e}.up_proj", f"mlp.experts.{e}.down_proj")
        for shared in ("shared_expert", "shared_experts"):
            if _get(mlp, shared) is not None:
                gates += [f"mlp.{shared}.gate_proj", f"mlp.{shared}.up_proj"]
                linear_pair(f"mlp.{shared}.up_proj", f"mlp.{shared}.down_proj")
    elif _get(mlp, "gate_up_proj") is not None:  # Phi-3: [gate; up] in one Linear, down reads act(gate) * up
        gates = ["mlp.gate_up_proj"]
        inter = _get(mlp, "down_proj").in_features
        linear_pair("mlp.gate_up_proj", "mlp.down_proj", rows=slice(inter, 2 * inter))
    else:
        gates = ["mlp.gate_proj", "mlp.up_proj"]
        ungated = "mlp has no gate_proj: down_proj reads act(up(x))"
        linear_pair("mlp.up_proj", "mlp.down_proj", None if _get(block, "mlp.gate_proj") is not None else ungated)
    if norm is None:
        notes.append(f"{','.join(gates[:2])}: no norm before them (the block normalizes after the MLP)")
    else:
        norm_pair(norm, gates, "mlp", placement)


def norm_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """find_mappings restricted to pairs whose inputs a norm produces, with the notes about them."""
    mappings, notes = find_mappings(block)
    linear_names = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    kept = [m for m in mappings if not isinstance(m.prev, nn.Linear)]
    return kept, [n for n in notes if n.split(" -> ", 1)[0] not in linear_names]
