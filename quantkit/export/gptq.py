"""The GPTQ checkpoint layout of AutoGPTQ / GPTQModel, as vLLM, SGLang and transformers load it.

Per quantized Linear `<m>`:
  <m>.qweight  int32 [in*bits/32, out]   codes packed along the input dim
  <m>.qzeros   int32 [groups, out*bits/32] zero points packed along the output dim
  <m>.scales   fp16  [groups, out]
  <m>.g_idx    int32 [in]                 group of each input column (col // group_size here)
Zero points: format v1 (`gptq`) stores zero-1 and cannot hold a true zero of 0, which asymmetric grids
produce; GPTQModel (and so transformers) also refuses asymmetric v1 from other producers, since old
AutoGPTQ wrote it wrongly. So symmetric grids (zero = 2^(bits-1)) are written as v1, which every loader
reads, and asymmetric ones as `gptq_v2` (zero stored as is), which GPTQModel, transformers and vLLM
(since PR #26092) read; a mixed recipe with any asymmetric grid is written as v2 whole.

Mixed precision (the recipe's overrides) is GPTQModel's `dynamic`: rules `+:<regex>` -> {bits, group_size, sym} for
the Linears on another grid than the top-level one, `-:<regex>` -> {} for those left float. GPTQModel
(quantization/config.py `dynamic_get`) and vLLM (gptq_utils.py `get_dynamic_override`) take the first rule, in
order, whose regex `re.match`es (start-anchored) the module's name, so each rule is anchored at both ends and names
its Linears exactly. vLLM asks with its fused layers' names (`...self_attn.qkv_proj`, `...mlp.gate_up_proj`, a MoE
layer's `...mlp.experts`) and GPTQModel with the checkpoint's, so a fused group's rule matches both.
"""

from __future__ import annotations

import re

import torch

from .. import __version__
from ..errors import QuantkitError
from . import packing
from .base import Encoded, GridSpec, QuantInfo, QuantizedWeight, trivial_g_idx
from .layout import F16, I32, Layout, Part, packed
from .registry import Format, register

MARKER = "qweight"


# vLLM's names for the Linears it fuses (its models' packed_modules_mapping; DeepSeek's fused_qkv_a_proj)
VLLM_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj", "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}
GRID_KEYS = ("bits", "group_size", "sym")  # what a `+:` rule overrides


def checkpoint_format(info: QuantInfo) -> str:
    return "gptq" if all(s.sym for s in (info.spec, *info.overrides.values())) else "gptq_v2"


def encode_module(qw: QuantizedWeight, fmt: str) -> dict[str, torch.Tensor]:
    bits = qw.spec.bits
    out, cols = qw.shape
    stored_zero = qw.zero.long() - (1 if fmt == "gptq" else 0)
    return {
        "qweight": packing.pack(qw.codes.T, bits, dim=0),
        "qzeros": packing.pack(stored_zero.T, bits, dim=1),
        "scales": qw.scale.T.contiguous().to(torch.float16),
        "g_idx": (torch.arange(cols) // qw.spec.span(cols)).to(torch.int32),
    }


def decode_module(t: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
    bits = int(qcfg["bits"])
    v1 = qcfg.get("checkpoint_format", qcfg.get("format", "gptq")) != "gptq_v2"
    scales = t["scales"]
    groups, out = scales.shape
    cols = t["qweight"].shape[0] * 32 // bits
    zero = packing.unpack(t["qzeros"], bits, out, dim=1).T + (1 if v1 else 0)
    group_size = int(qcfg.get("group_size", -1))
    spec = GridSpec(bits, group_size if groups > 1 else -1, bool(qcfg.get("sym", True)))
    g_idx = trivial_g_idx(t.get("g_idx"), spec.span(cols))
    return QuantizedWeight(
        codes=packing.unpack(t["qweight"], bits, cols, dim=0).T.to(torch.uint8),
        scale=scales.T.contiguous(),
        zero=zero.to(torch.uint8),
        spec=spec,
        g_idx=g_idx,
    )


def encode(qweights: dict[str, QuantizedWeight], info: QuantInfo) -> Encoded:
    fmt = checkpoint_format(info)
    tensors = {
        f"{name}.{suffix}": t
        for name, qw in qweights.items()
        for suffix, t in encode_module(qw, fmt).items()
    }
    # Linear layers inside the blocks that stay float: GPTQModel/vLLM's per-module "dynamic" exclusion; then the
    # overrides' grids (no rule matches both a float and a quantized Linear, so their order does not matter)
    dynamic = {
        f"-:^{re.escape(name)}$": {}
        for name in info.unquantized_linears
        if name.startswith(info.block_linears_prefix + ".")
    }
    for spec, rules in dynamic_rules(info).items():
        dynamic |= {f"+:{rule}": {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym} for rule in rules}
    cfg = {
        "quant_method": "gptq",
        "bits": info.spec.bits,
        "group_size": info.spec.group_size,
        # quantkit's act-order is group-aware (GPTQModel's act_group_aware): groups stay contiguous and g_idx trivial,
        # so loaders must not permute by g_idx. desc_act false also keeps vLLM's fast kernels, and its MoE loader
        # (which rejects desc_act checkpoints).
        "desc_act": False,
        "act_group_aware": info.act_order,
        "sym": info.spec.sym,
        "lm_head": False,
        "true_sequential": True,
        "damp_percent": info.damp if info.damp is not None else 0.0,
        "checkpoint_format": fmt,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"quantkit:{__version__}"], "method": info.method},
    }
    if dynamic:
        cfg["dynamic"] = dynamic
    return Encoded(tensors, cfg, {"quantize_config.json": {k: v for k, v in cfg.items() if k != "quant_method"}})


def _unit(inside: str) -> tuple[str, str, str]:
    """(kind, stem, leaf) of a Linear's name inside its block: a MoE layer's experts and a fused layer's members share
    one rule (they share one grid: overrides.resolve)."""
    head, sep, tail = inside.rpartition(".experts.")
    if sep and tail.partition(".")[0].isdigit():
        return "experts", head, tail.partition(".")[2]
    parent, dot, leaf = inside.rpartition(".")
    return ("fused", parent, leaf) if dot and leaf in VLLM_FUSED else ("one", inside, "")


def _unit_regex(kind: str, stem: str, leaves: list[str]) -> str:
    alt = "|".join(map(re.escape, leaves))
    if kind == "experts":  # vLLM: <stem>.experts; GPTQModel: <stem>.experts.<e>.<leaf>
        return rf"{re.escape(stem)}\.experts(?:\.\d+\.(?:{alt}))?"
    if kind == "fused":  # the members, and vLLM's fused layer
        return rf"{re.escape(stem)}\.(?:{alt})"
    return re.escape(stem)


def dynamic_rules(info: QuantInfo) -> dict[GridSpec, list[str]]:
    """Each override grid's regexes, anchored, naming exactly its Linears: one per Linear (or fused layer, or MoE
    layer's experts) of a block, listing the blocks that have it on this grid."""
    prefix = info.block_linears_prefix
    by_spec: dict[GridSpec, dict[tuple[str, str], tuple[list[str], list[str]]]] = {}
    exact: dict[GridSpec, list[str]] = {}
    for name in info.linears:
        spec = info.overrides.get(name)
        if spec is None:
            continue
        head, sep, rest = name.partition(prefix + ".")
        index, _, inside = rest.partition(".")
        if head or not sep or not index.isdigit():
            exact.setdefault(spec, []).append(f"^{re.escape(name)}$")
            continue
        kind, stem, leaf = _unit(inside)
        leaves, blocks = by_spec.setdefault(spec, {}).setdefault((kind, stem), ([], []))
        for seen, new in ((leaves, leaf), (blocks, index)):
            if new not in seen:
                seen.append(new)
    rules = {spec: list(names) for spec, names in exact.items()}
    for spec, units in by_spec.items():
        for (kind, stem), (leaves, blocks) in units.items():
            if kind == "fused":
                leaves = leaves + sorted({VLLM_FUSED[leaf] for leaf in leaves} - set(leaves))
            alt = "|".join(sorted(blocks, key=int))
            where = f"(?:{alt})" if len(blocks) > 1 else alt
            unit = _unit_regex(kind, stem, leaves)
            rules.setdefault(spec, []).append(f"^{re.escape(prefix)}\\.{where}\\.{unit}$")
    return rules


def grid_config(qcfg: dict, module: str | None) -> dict:
    """The quantization_config as Linear `module` reads it: the first `dynamic` rule whose regex re.match-es its name
    (GPTQModel's dynamic_get, vLLM's get_dynamic_override) overrides bits / group_size / sym."""
    dynamic = qcfg.get("dynamic") or {}
    if module is None or not dynamic:
        return qcfg
    if not isinstance(dynamic, dict):
        raise QuantkitError("quantization_config.dynamic: a mapping of '+:' / '-:' regexes to overrides")
    for pattern, rule in dynamic.items():
        try:
            hit = re.match(pattern[2:] if pattern.startswith(("+:", "-:")) else pattern, module)
        except re.error as exc:
            raise QuantkitError(f"quantization_config.dynamic: {pattern!r} is not a regex ({exc})") from None
        if hit is None:
            continue
        if pattern.startswith("-:"):
            raise QuantkitError(f"quantization_config.dynamic: {module} is stored quantized but {pattern!r} leaves "
                                "it float")
        if not isinstance(rule, dict):
            raise QuantkitError(f"quantization_config.dynamic.{pattern}: a mapping of overrides")
        return qcfg | {k: rule[k] for k in GRID_KEYS if k in rule}
    return qcfg


PARTS = {
    "qweight": Part(I32, lambda d: [[packed(d.cols, d.bits), d.out]]),
    "qzeros": Part(I32, lambda d: [[d.groups, packed(d.out, d.bits)]]),
    "scales": Part(F16, lambda d: [[d.groups, d.out]]),
    "g_idx": Part(I32, lambda d: [[d.cols]], required=False),
}


class Gptq(Format):
    name = "gptq"
    bits = (2, 3, 4, 8)
    mixed = True
    loaders = [
        ("vLLM / SGLang", "vllm serve {path}  # gptq / gptq_marlin kernels"),
        ("transformers (with gptqmodel)", "AutoModelForCausalLM.from_pretrained('{path}', device_map='auto')"),
    ]

    def packed_dims(self, out: int, cols: int) -> dict[str, int]:
        return {"in_features": cols, "out_features": out}  # qweight along in, qzeros along out

    def encode(self, qweights, info: QuantInfo, dtype: torch.dtype) -> Encoded:
        self.require_weight_only(info)
        return encode(qweights, info)

    def marker(self, qcfg: dict) -> str:
        return MARKER

    def decode(self, parts: dict[str, torch.Tensor], qcfg: dict, module: str | None = None) -> QuantizedWeight:
        return decode_module(parts, grid_config(qcfg, module))

    def layout(self, qcfg: dict, module: str | None = None) -> Layout:
        qcfg = grid_config(qcfg, module)
        return Layout(self.name, PARTS, int(qcfg["bits"]), int(qcfg["group_size"]))


register(Gptq())
