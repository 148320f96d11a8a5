"""Mixture-of-experts blocks as per-expert Linear layers.

transformers 5 keeps a block's experts as fused 3-D parameters, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I],
built at load time from the checkpoint's per-expert tensors by its conversion mapping. GPTQ, AWQ and RTN work on
Linear layers with their own inputs, so `unfuse` replaces each fused experts module with `Experts`: one `Expert`
(gate_proj, up_proj, down_proj nn.Linears) per expert, holding the same weights and computing the same routed
output, in the same order, as transformers' eager loop. The quantized model keeps this layout, and the artifact
stores each expert under the name the original checkpoint gives it (`checkpoint_names`), which is what vLLM's
FusedMoE loader and transformers' own conversion read.

With `calibrate_all` on (the quantize pipeline sets it), every token also goes through every expert once, so each
expert's statistics cover the whole calibration set; the block's output still comes only from the routed tokens,
computed on their own so it is exactly what the routed model computes. Hooks that gather statistics skip that
second, routed call (`replaying`): the tokens were already counted.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..errors import QuantkitError
from .family import supported


class Expert(nn.Module):
    """One expert's gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, act_fn, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def observe(self, x: torch.Tensor) -> None:
        """The statistics pass over every token: gate and up run, down_proj's pre-hooks (Hessians, AWQ statistics,
        quantizing its weight) see its input, but its matmul is skipped: that output would be thrown away."""
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        with_kwargs = self.down_proj._forward_pre_hooks_with_kwargs
        for key, hook in list(self.down_proj._forward_pre_hooks.items()):
            hook(self.down_proj, (h,), {}) if key in with_kwargs else hook(self.down_proj, (h,))


class Experts(nn.ModuleList):
    """Drop-in for a fused experts module: forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, experts: list[Expert]):
        super().__init__(experts)
        self.calibrate_all = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            # the positions in transformers' order: by top-k slot, then token (its one_hot mask, permuted)
            pos, tok = torch.where((top_k_index == e).T)
            if self.calibrate_all:
                expert.observe(hidden_states)  # statistics over every token; the output comes from the routed ones
            if tok.numel() == 0:
                continue
            with replay(expert, self.calibrate_all):
                y = expert(hidden_states[tok])
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


@contextmanager
def calibrating(experts: list[Experts], all_experts: bool):
    """Every token through every expert (all_experts) for the forwards inside; routed only again afterwards."""
    for e in experts:
        e.calibrate_all = all_experts
    try:
        yield
    finally:
        for e in experts:
            e.calibrate_all = False


class replay:
    """Marks an expert's Linears as re-reading tokens already counted (see `replaying`)."""

    def __init__(self, expert: Expert, on: bool):
        self.linears, self.on = [m for m in expert.modules() if isinstance(m, nn.Linear)], on

    def __enter__(self):
        for m in self.linears:
            m._quantkit_replay = self.on

    def __exit__(self, *exc):
        for m in self.linears:
            m._quantkit_replay = False


def replaying(module: nn.Module) -> bool:
    """True during the routed call of an expert whose tokens were all counted already: statistics hooks skip it."""
    return getattr(module, "_quantkit_replay", False)


def _fused(module: nn.Module) -> bool:
    p = module._parameters
    return isinstance(p.get("gate_up_proj"), torch.Tensor) and isinstance(p.get("down_proj"), torch.Tensor) \
        and p["gate_up_proj"].dim() == 3


def unfuse(model: nn.Module) -> int:
    """Replaces every fused experts module of `model` by `Experts` holding the same weights (meta stays meta);
    returns how many were replaced. A layout other than transformers' default ([gate; up] concatenated, [out, in]
    per expert, no bias) fails with one line naming its class."""
    found = [name for name, m in model.named_modules() if _fused(m)]  # names: each fused module goes when replaced
    for name in found:
        fused = model.get_submodule(name)
        cls = type(fused).__name__
        layout = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True}
        odd = [k for k, want in layout.items() if getattr(fused, k, want) != want]
        if odd or not hasattr(fused, "act_fn"):
            raise QuantkitError(f"model: {cls} stores its experts with {', '.join(odd) or 'no act_fn'}; quantkit "
                                "unfuses [gate; up] concatenated, untransposed, bias-free experts only (supported: "
                                f"{supported()})")
        gate_up, down = fused.gate_up_proj, fused.down_proj
        n, two_inter, hidden = gate_up.shape
        inter = two_inter // 2
        if tuple(down.shape) != (n, hidden, inter):
            raise QuantkitError(f"model: {cls}.down_proj has shape {tuple(down.shape)}, expected {(n, hidden, inter)}")
        experts = []
        for e in range(n):
            ex = Expert(hidden, inter, fused.act_fn, gate_up.dtype, gate_up.device)
            if gate_up.device.type != "meta":
                with torch.no_grad():
                    ex.gate_proj.weight.copy_(gate_up[e, :inter])
                    ex.up_proj.weight.copy_(gate_up[e, inter:])
                    ex.down_proj.weight.copy_(down[e])
            experts.append(ex)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, Experts(experts))
        del fused, gate_up, down
    return len(found)


def experts_of(model: nn.Module) -> list[tuple[str, Experts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]


class CheckpointNames:
    """Model state_dict keys -> the original checkpoint's keys (identity where they agree), for tensors and for the
    module prefixes of packed tensors (`experts.0.gate_proj` -> `block_sparse_moe.experts.0.w1` on Mixtral)."""

    def __init__(self, tensors: dict[str, str]):
        self.tensors = tensors
        self.modules = {}
        for ours, theirs in tensors.items():
            m, _, leaf = ours.rpartition(".")
            m2, _, leaf2 = theirs.rpartition(".")
            if leaf == leaf2:
                self.modules[m] = m2

    def __call__(self, key: str) -> str:
        if key in self.tensors:
            return self.tensors[key]
        module, _, leaf = key.rpartition(".")
        return f"{self.modules[module]}.{leaf}" if module in self.modules else key

    def module(self, name: str) -> str:
        return self.modules.get(name, name)

    def inverse(self) -> "CheckpointNames":
        return CheckpointNames({v: k for k, v in self.tensors.items()})


def checkpoint_names(fused_model: nn.Module) -> CheckpointNames:
    """The names the original checkpoint stores the unfused model's tensors under, where they differ.

    Found with transformers' own `revert_weight_conversion` (what save_pretrained writes) on tagged stand-ins: every
    tensor becomes a small float64 tensor of unique integers, a fused experts tensor one of shape [E, 2, 1] (gate_up)
    or [E, 1, 1] (down), so where each value lands after the reverse conversion names its source."""
    from transformers.core_model_loading import revert_weight_conversion

    state = fused_model.state_dict(keep_vars=True)
    tagged, source, seen, uid = {}, {}, set(), 0
    for key, t in state.items():
        if id(t) in seen:  # tied: save_pretrained stores it once
            continue
        seen.add(id(t))
        module, _, leaf = key.rpartition(".")
        if _fused(fused_model.get_submodule(module)) and leaf in ("gate_up_proj", "down_proj"):
            n = t.shape[0]
            parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            values = torch.arange(uid, uid + n * len(parts), dtype=torch.float64).reshape(n, len(parts), 1)
            for e in range(n):
                for j, part in enumerate(parts):
                    source[uid + e * len(parts) + j] = f"{module}.{e}.{part}.weight"
            uid += n * len(parts)
        else:
            values = torch.tensor([float(uid)], dtype=torch.float64)
            source[uid] = key
            uid += 1
        tagged[key] = values
    try:
        reverted = revert_weight_conversion(fused_model, tagged)
    except Exception as err:  # a conversion that needs real shapes: names cannot be inferred
        raise QuantkitError(f"model: cannot infer {type(fused_model).__name__}'s checkpoint tensor names "
                            f"({type(err).__name__}: {err})") from None
    names = {}
    for ckpt_key, t in reverted.items():
        ours = source[int(t.flatten()[0].item())]
        if ours != ckpt_key:
            names[ours] = ckpt_key
    return CheckpointNames(names)


def prepare(model: nn.Module) -> CheckpointNames:
    """Unfuses model's experts in place; returns the checkpoint names of its (now unfused) tensors."""
    names = checkpoint_names(model)
    unfuse(model)
    return names
