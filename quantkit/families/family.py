"""A model family as data, the registry that knows them, and `Pairs`, the checked builder a family's mapping
function fills.

A `Family` says which models it covers (config.json `model_type`s, decoder block classes), which module classes
behave as scale folding needs (norms, QK norms, MoE routers), which (prev -> Linears) pairs its blocks fold, and what
engines refuse for it. Built-in families register themselves from one module each (llama.py, gemma.py, ...); a user
or a test registers its own with `register`, without editing quantkit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from ..algorithms.smoothing import Mapping


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str  # as the supported-families message lists it; "" for a family not tested end to end
    mappings: Callable[[Pairs], None]  # adds one decoder block's foldable pairs (and notes) to a Pairs
    model_types: tuple[str, ...] = ()  # config.json model_type values it covers
    blocks: tuple[str, ...] = ()  # decoder block class names it covers (find_mappings sees only a block)
    norms: tuple[str, ...] = ()  # norm classes computing weight * normalize(x) (+ bias)
    offset_norms: tuple[str, ...] = ()  # norm classes computing (1 + weight) * normalize(x): fold into (1 + w)
    qk_norms: tuple[str, ...] = ()  # modules inside self_attn that act on queries and keys only (v -> o stays exact)
    routers: tuple[str, ...] = ()  # MoE routing Linears under mlp: left in float; a family with routers is MoE
    vllm_float16: bool = True  # False where vLLM refuses float16 for the model_type


_REGISTERED: list[Family] = []  # in registration order: the supported-families message keeps it
_fallback: Family | None = None  # the family of models no registered family claims (generic.py's)


def register(family: Family, fallback: bool = False) -> Family:
    """Adds `family`; a later registration wins a model_type or block class an earlier one covers. `fallback`: it
    becomes the family of every model no other family claims (replacing the previous fallback)."""
    global _fallback
    if fallback:
        _fallback = family
    else:
        _REGISTERED.append(family)
    return family


def family_of(subject) -> Family:
    """The family of a model, a decoder block (both: their config's model_type, then their module classes), or a
    config (a transformers config or a config.json dict: its model_type); else the fallback."""
    if isinstance(subject, dict):
        model_type, classes = subject.get("model_type"), []
    else:
        model_type = getattr(getattr(subject, "config", subject), "model_type", None)
        classes = [type(m).__name__ for m in subject.modules()] if isinstance(subject, nn.Module) else []
    newest_first = _REGISTERED[::-1]
    found = next((f for f in newest_first if model_type in f.model_types), None) or next(
        (f for c in classes for f in newest_first if c in f.blocks), None)
    return found or _fallback


def supported() -> str:
    """The families tested end to end, for messages: "Llama, ..., OPT; MoE: Qwen3-MoE, ..."."""
    dense = [f.name for f in _REGISTERED if f.name and not f.routers]
    moe = [f.name for f in _REGISTERED if f.name and f.routers]
    return ", ".join(dense) + (f"; MoE: {', '.join(moe)}" if moe else "")


def pooled(field: Literal["norms", "offset_norms", "qk_norms", "routers"]) -> tuple[str, ...]:
    """What every family (the fallback included) says about module classes and names, together, in registration
    order: what a norm class computes does not depend on the block it sits in."""
    return tuple(dict.fromkeys(n for f in [*_REGISTERED, _fallback] if f for n in getattr(f, field)))


class Pairs:
    """The (prev -> Linears) pairs of one decoder block that can fold a per-channel scale, each checked against the
    module structure before it is kept; a pair that cannot be verified is skipped with a note, never guessed."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.mappings: list[Mapping] = []
        self.notes: list[str] = []
        self.norms, self.offset_norms = set(pooled("norms")), set(pooled("offset_norms"))
        self.qk_norms, self.routers = set(pooled("qk_norms")), pooled("routers")

    def get(self, path: str) -> nn.Module | None:
        try:
            return self.block.get_submodule(path)
        except AttributeError:
            return None

    def has(self, path: str) -> bool:
        return self.get(path) is not None

    def _linears(self, names: Sequence[str]) -> list[nn.Module] | None:
        mods = [self.get(n) for n in names]
        ok = all(isinstance(m, nn.Linear) or (n.rpartition(".")[2] in self.routers and getattr(m, "weight", None)
                                              is not None) for n, m in zip(names, mods))
        return mods if ok and mods else None

    def _norm_problem(self, norm: nn.Module | None, linears: list[nn.Module]) -> str | None:
        if norm is None:
            return "not found"
        if type(norm).__name__ not in self.norms | self.offset_norms:
            return f"{type(norm).__name__} is not known to compute weight * normalize(x) + bias"
        weight = getattr(norm, "weight", None)
        if weight is None:
            return "has no affine weight to fold into"
        if any(lin.weight.shape[1] != weight.numel() for lin in linears):
            return "width does not match the Linear inputs"
        return None

    def norm(self, norm_name: str, names: Sequence[str], inspect_name: str, placement: str | None = None) -> None:
        """norm_name -> names, the error measured on inspect_name's output; `placement`: why the norm may not be
        what feeds them (skips the pair)."""
        lins = self._linears(names)
        if lins is None:
            self.notes.append(f"{norm_name} -> {','.join(names)}: skipped, Linear layers not found")
            return
        norm = self.get(norm_name)
        problem = placement or self._norm_problem(norm, lins)
        if problem:
            self.notes.append(f"{norm_name} -> {','.join(names)}: skipped, {norm_name} {problem}")
            return
        self.mappings.append(Mapping(norm, norm_name, lins, list(names), self.get(inspect_name), inspect_name,
                                     offset=type(norm).__name__ in self.offset_norms))

    def linear(self, prev_name: str, name: str, problem: str | None = None, rows: slice | None = None) -> None:
        """prev_name (a Linear, only its output `rows` if set) -> name; `problem`: why it must be skipped."""
        prev, lin = self.get(prev_name), self.get(name)
        if not (isinstance(prev, nn.Linear) and isinstance(lin, nn.Linear)):
            self.notes.append(f"{prev_name} -> {name}: skipped, Linear layers not found")
            return
        width = prev.out_features if rows is None else len(range(prev.out_features)[rows])
        if width != lin.in_features:
            # GQA: v_proj has fewer outputs than o_proj has inputs (llm-awq PR #67)
            self.notes.append(f"{prev_name} -> {name}: skipped, {prev_name}.out_features {width} != "
                              f"{name}.in_features {lin.in_features}")
        elif problem:
            self.notes.append(f"{prev_name} -> {name}: skipped, {problem}")
        else:
            self.mappings.append(Mapping(prev, prev_name, [lin], [name], lin, name, rows))

    def attention_problem(self) -> str | None:
        """Why v -> the output projection may not be exact: o_proj reads softmax(qk)·v per head, unless something
        else in self_attn acts on v."""
        attn = self.get("self_attn")
        extra = sorted(n for n, m in attn.named_modules() if n and "norm" in type(m).__name__.lower()
                       and n not in self.qk_norms)
        return f"self_attn has {', '.join(extra)} that may act on v" if extra else None
