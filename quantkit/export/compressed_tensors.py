"""compressed-tensors: the layouts llm-compressor writes and vLLM / transformers load.

`pack-quantized` (weight-only int, W4A16 / W8A16, and W2A16 / W3A16: compressed-tensors packs 1 to 8 bits densely,
values crossing words, as export/packing.py does), per quantized Linear `<m>`:
  <m>.weight_packed      int32 [out, in*bits/32]  signed codes + 2^(bits-1), packed along the input dim
  <m>.weight_scale       [out, groups]            (channel strategy: [out, 1])
  <m>.weight_zero_point  int32 [out*bits/32, groups]  asymmetric only: signed zero + 2^(bits-1), packed along out
  <m>.weight_shape       int64 [2]
`int-quantized` (W8A8 int8; W4AFP8) and `float-quantized` (W8A8 FP8 e4m3), per quantized Linear `<m>`:
  <m>.weight        int8 (signed code) | float8_e4m3fn  [out, in]  (W4AFP8: the int4 value, -8..7, one a byte, as
                    compressed-tensors' IntQuantizationCompressor writes it: its pack-quantized takes no FP8 inputs)
  <m>.weight_scale  [out, 1]  (W4AFP8: [out, in/group], the float dtype W4A16's take; FP8: float32; [1] per tensor,
                    the FP8 preset; [out/rows, in/cols] per block, FP8_BLOCK, the config's weights.block_structure)
  <m>.input_scale   float32 [1]  FP8 static inputs only (the FP8 preset: input_activations dynamic false, tensor)
  Other inputs are quantized at run time (dynamic) per token, or per group of input_activations.group_size columns
  (FP8_BLOCK), so no input scale is stored.
With an FP8 KV cache (any of those), per attention module `<a>` (`*.self_attn`), and `kv_cache_scheme` (8-bit float,
symmetric, static, strategy tensor | attn_head) in the quantization_config, as llm-compressor writes them:
  <a>.k_scale, <a>.v_scale  float32 [1] (tensor) | [kv_heads, 1, 1] (attn_head)
  (llm-compressor keeps them in the model's dtype; vLLM reads them into float32 either way, and float32 keeps
  amax / 448 exact.)
`nvfp4-pack-quantized` / `mxfp4-pack-quantized` (NVFP4A16 / MXFP4A16, NVFP4 / MXFP4): export/ct_fp4.py.
`mxfp8-quantized` (MXFP8A16 / MXFP8): export/ct_mxfp8.py.
The quantization_config is produced by compressed-tensors' own pydantic classes.
"""

from __future__ import annotations

import re

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from ..algorithms.grid import INT8_CHANNEL
from ..errors import QuantkitError
from ..algorithms.scheme import QuantizedTensor
from . import ct_fp4, ct_mxfp8, packing
from .base import (STATIC_OBSERVERS, Encoded, Fp8BlockWeight, Fp8Weight, GridSpec, QuantInfo, QuantizedWeight,
                   trivial_g_idx)
from .layout import FLOATS, I32, I64, Layout, Part, packed
from .registry import Format, register

PACKED, INT, FLOAT = "pack-quantized", "int-quantized", "float-quantized"
MARKERS = {PACKED: "weight_packed", INT: "weight_scale", FLOAT: "weight_scale"}  # the tensor a quantized module has
MARKERS |= {fmt: "weight_packed" for fmt in ct_fp4.PRESET}  # FP4: export/ct_fp4.py
MARKERS[ct_mxfp8.FORMAT] = "weight_scale"  # MXFP8: export/ct_mxfp8.py
MARKER = MARKERS[PACKED]
W8A8_FORMATS = {"int8": INT, "fp8": FLOAT}  # QuantInfo.activations -> format
KV_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}  # QuantInfo.kv_cache -> kv_cache_scheme.strategy


def encode_module(qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # codes and zeros are unsigned 0..2^bits-1 here; compressed-tensors' signed value + 2^(bits-1) is the
    # same number, so they pack unchanged.
    t = {
        "weight_packed": packing.pack(qw.codes, qw.spec.bits, dim=1),
        "weight_scale": qw.scale.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor(list(qw.shape), dtype=torch.int64),
    }
    if not qw.spec.sym:
        t["weight_zero_point"] = packing.pack(qw.zero, qw.spec.bits, dim=0)
    return t


def format_of(qcfg: dict) -> str:
    fmt = qcfg.get("format") or PACKED
    if fmt not in MARKERS:
        raise QuantkitError(f"quantization_config.format: '{fmt}' is not one quantkit reads ({', '.join(MARKERS)})")
    return fmt


def marker(qcfg: dict) -> str:
    """The tensor suffix that marks a quantized module in a checkpoint of this config's format."""
    return MARKERS[format_of(qcfg)]


def encode_int_module(qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # the signed value, one int8 each (W4AFP8's int4 too: compressed-tensors' IntQuantizationCompressor packs nothing)
    return {
        "weight": (qw.codes.to(torch.int16) - (1 << (qw.spec.bits - 1))).to(torch.int8).contiguous(),
        "weight_scale": qw.scale.to(scale_dtype).reshape(qw.shape[0], -1).contiguous(),  # [out, 1 | groups]
    }


def encode_float_module(fw: Fp8Weight | Fp8BlockWeight) -> dict[str, torch.Tensor]:
    if isinstance(fw, Fp8BlockWeight):
        scale = fw.scale
    else:  # per tensor: [1], as compressed-tensors stores a tensor strategy's scale
        scale = fw.scale.reshape(-1) if fw.per_tensor else fw.scale.reshape(-1, 1)
    t = {"weight": fw.weight.contiguous(), "weight_scale": scale.float().contiguous()}
    if getattr(fw, "input_scale", None) is not None:
        t["input_scale"] = fw.input_scale.float().reshape(1).contiguous()
    return t


def _channel_scale(t: dict[str, torch.Tensor]) -> torch.Tensor:
    # llm-compressor also writes per-tensor scales ([1]) in these formats; vLLM broadcasts them the same way
    out, scale = t["weight"].shape[0], t["weight_scale"]
    if scale.numel() not in (1, out):
        raise QuantkitError(f"weight_scale: {tuple(scale.shape)} is neither per-channel nor per-tensor for {out} rows")
    if "weight_zero_point" in t:
        raise QuantkitError("weight_zero_point: asymmetric W8A8 weights are not supported (vLLM runs symmetric ones)")
    return scale.reshape(-1, 1).expand(out, 1).contiguous()


def decode_int_module(t: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
    q = t["weight"]
    if q.dtype != torch.int8:
        raise QuantkitError(f"weight: int-quantized weights are int8, got {q.dtype}")
    spec = int_grid(qcfg)
    if spec.bits == 4:  # W4AFP8: signed int4 values, a scale per group
        if q.min() < -8 or q.max() > 7:
            raise QuantkitError("weight: W4AFP8 weights are int4 values (-8..7) in int8")
        scale = t["weight_scale"]
        if list(scale.shape) != [q.shape[0], spec.groups(q.shape[1])]:
            raise QuantkitError(f"weight_scale: {list(scale.shape)} is not one scale per {spec.span(q.shape[1])} "
                                f"columns of {list(q.shape)}")
        return QuantizedWeight((q + 8).to(torch.uint8), scale, torch.full(scale.shape, 8, dtype=torch.uint8), spec)
    return QuantizedWeight(
        codes=(q.to(torch.int16) + 128).to(torch.uint8),
        scale=_channel_scale(t),
        zero=torch.full((q.shape[0], 1), 128, dtype=torch.uint8),
        spec=INT8_CHANNEL,
    )


def _args(qcfg: dict, key: str = "weights") -> dict:
    """The first config group's weights (or input_activations) arguments; {} where there are none."""
    groups = [g for g in (qcfg.get("config_groups") or {}).values() if isinstance(g, dict)]
    return (groups[0].get(key) or {}) if groups else {}


def int_grid(qcfg: dict) -> GridSpec:
    """An int-quantized config's weight grid: W8A8's int8 per channel, or W4AFP8's int4 groups (symmetric)."""
    w = _args(qcfg)
    if int(w.get("num_bits") or 8) != 4:
        return INT8_CHANNEL
    if not w.get("symmetric", True):
        raise QuantkitError("weights.symmetric: int-quantized int4 weights are symmetric (W4AFP8)")
    return GridSpec(4, int(w.get("group_size") or -1) if w.get("strategy") == "group" else -1, True)


def block_of(qcfg: dict) -> tuple[int, int] | None:
    """weights.block_structure of a block-strategy config (quantkit writes one config group)."""
    weights = _args(qcfg)
    return tuple(int(x) for x in weights["block_structure"]) if weights.get("strategy") == "block" else None


def decode_float_module(t: dict[str, torch.Tensor], block: tuple[int, int] | None = None) -> QuantizedTensor:
    q = t["weight"]
    if q.dtype != torch.float8_e4m3fn:
        raise QuantkitError(f"weight: float-quantized weights are float8_e4m3fn, got {q.dtype}")
    if block is not None:
        want = [-(-q.shape[0] // block[0]), -(-q.shape[1] // block[1])]
        if list(t["weight_scale"].shape) != want:
            raise QuantkitError(f"weight_scale: {list(t['weight_scale'].shape)} is not one scale per {list(block)} "
                                f"block of {list(q.shape)} ({want})")
        return Fp8BlockWeight(q, t["weight_scale"].float(), block)
    input_scale = t.get("input_scale")
    return Fp8Weight(q, _channel_scale(t).float(), None if input_scale is None else input_scale.float().reshape(1))


def decode_module(t: dict[str, torch.Tensor], qcfg: dict, module: str | None = None) -> QuantizedTensor:
    fmt = format_of(qcfg)
    if fmt == INT:
        return decode_int_module(t, qcfg)
    if fmt == FLOAT:
        return decode_float_module(t, block_of(qcfg))
    if fmt in ct_fp4.PRESET:
        return ct_fp4.decode_module(t, fmt)
    if fmt == ct_mxfp8.FORMAT:
        return ct_mxfp8.decode_module(t)
    # a uniform recipe (and llm-compressor's W4A16 presets) has one config group targeting Linear; a mixed one a group
    # per grid (group_for)
    w = group_for(qcfg, module)["weights"]
    bits, sym = int(w["num_bits"]), bool(w["symmetric"])
    out, cols = (int(x) for x in t["weight_shape"])
    scale = t["weight_scale"]
    groups = scale.shape[1]
    offset = 1 << (bits - 1)
    if sym:
        zero = torch.full((out, groups), offset, dtype=torch.uint8)
    else:
        zero = packing.unpack(t["weight_zero_point"], bits, out, dim=0).to(torch.uint8)
    spec = GridSpec(bits, int(w.get("group_size") or -1) if groups > 1 else -1, sym)
    return QuantizedWeight(
        codes=packing.unpack(t["weight_packed"], bits, cols, dim=1).to(torch.uint8),
        scale=scale,
        zero=zero,
        spec=spec,
        g_idx=trivial_g_idx(t.get("weight_g_idx"), spec.span(cols)),
    )


def encode_w8a8(qweights: dict[str, QuantizedTensor], info: QuantInfo, scale_dtype: torch.dtype) -> Encoded:
    """int-quantized (int8 weights) or float-quantized (FP8 weights), activations dynamic per token: llm-compressor's
    W8A8 and FP8_DYNAMIC presets, the schemes vLLM runs as CompressedTensorsW8A8Int8 / CompressedTensorsW8A8Fp8."""
    w4 = info.scheme.kind == "int" and info.activations == "fp8"  # W4AFP8: int4 groups, int-quantized
    fmt = INT if w4 else W8A8_FORMATS.get(info.activations)
    if fmt is None:
        raise QuantkitError(f"activations: '{info.activations}' is not one of {', '.join(W8A8_FORMATS)}")
    want = info.spec if w4 else INT8_CHANNEL
    wanted = f"W4AFP8's {info.spec}" if w4 else "8-bit symmetric per-channel"
    tensors = {}
    for name, qw in qweights.items():
        if fmt == INT and getattr(qw, "spec", None) != want:
            got = getattr(qw, "spec", type(qw).__name__)
            raise QuantkitError(f"{name}: int-quantized needs {wanted} int weights, got {got}")
        if fmt == FLOAT and qw.scheme.kind != "float":
            raise QuantkitError(f"{name}: float-quantized needs FP8 weights, got {type(qw).__name__}")
        parts = encode_int_module(qw, scale_dtype) if fmt == INT else encode_float_module(qw)
        tensors.update({f"{name}.{suffix}": t for suffix, t in parts.items()})
    kind = "int" if fmt == INT else "float"
    strategy = "block" if info.block else "tensor" if info.per_tensor else "channel"
    grouped = w4 and info.spec.group_size != -1
    static = info.act_strategy == "tensor"
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=info.spec.bits if w4 else 8, type=kind, symmetric=True,
                                 strategy="group" if grouped else strategy, observer="minmax",
                                 group_size=info.spec.group_size if grouped else None,
                                 block_structure=list(info.block) if info.block else None,
                                 actorder="weight" if info.act_order else None),  # as the W4A16 groups say it
        input_activations=QuantizationArgs(num_bits=8, type="float" if w4 else kind, symmetric=True,
                                           strategy=info.act_strategy,
                                           group_size=info.act_group, dynamic=not static,
                                           **({"observer": STATIC_OBSERVERS[info.act_observer]} if static else {})),
        format=fmt,
    )
    return Encoded(tensors, _config(scheme, info, fmt))


def kv_cache_scheme(strategy: str) -> QuantizationArgs:
    """llm-compressor's FP8 KV cache: e4m3, symmetric, static scales."""
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, strategy=KV_STRATEGIES[strategy])


def _config(scheme: QuantizationScheme | list[QuantizationScheme], info: QuantInfo, fmt: str) -> dict:
    schemes = scheme if isinstance(scheme, list) else [scheme]
    config = QuantizationConfig(
        config_groups={f"group_{i}": s for i, s in enumerate(schemes)},
        ignore=sorted(info.unquantized_linears),
        format=fmt,
        quantization_status="compressed",
        kv_cache_scheme=None if info.kv_cache is None else kv_cache_scheme(info.kv_cache),
    )
    return config.model_dump(mode="json", exclude_none=False)


def encode(qweights: dict[str, QuantizedTensor], info: QuantInfo, scale_dtype: torch.dtype) -> Encoded:
    if info.scheme.kind == "mxfp8":
        tensors, scheme = ct_mxfp8.encode(qweights, info)
        return Encoded(tensors, _config(scheme, info, scheme.format))
    if info.scheme.kind == "fp4":
        tensors, scheme = ct_fp4.encode(qweights, info)
        return Encoded(tensors, _config(scheme, info, scheme.format))
    if info.activations is not None:
        return encode_w8a8(qweights, info, scale_dtype)
    tensors = {
        f"{name}.{suffix}": t
        for name, qw in qweights.items()
        for suffix, t in encode_module(qw, scale_dtype).items()
    }
    if not info.overrides:
        scheme = QuantizationScheme(targets=["Linear"], weights=_int_args(info.spec, info), format=PACKED)
        return Encoded(tensors, _config(scheme, info, PACKED))
    by_spec: dict[GridSpec, list[str]] = {info.spec: []}
    for name in info.linears:
        by_spec.setdefault(info.spec_for(name), []).append(name)
    schemes = [QuantizationScheme(targets=name_targets(names, info.block_linears_prefix),
                                  weights=_int_args(spec, info), format=PACKED)
               for spec, names in by_spec.items() if names]
    return Encoded(tensors, _config(schemes, info, PACKED))


def _int_args(spec: GridSpec, info: QuantInfo) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=spec.bits,
        type="int",
        symmetric=spec.sym,
        strategy="channel" if spec.group_size == -1 else "group",
        group_size=None if spec.group_size == -1 else spec.group_size,
        actorder="weight" if info.act_order else None,  # static groups: no g_idx needed
        observer="minmax",
    )


def name_targets(names: list[str], prefix: str) -> list[str]:
    """Config group targets that match exactly `names` among the model's Linears: one anchored regex per Linear of a
    block, listing the blocks that have it in this group (a MoE layer's experts share one grid: any expert index).
    No class name ('Linear'): vLLM and compressed-tensors give a name or regex match precedence over it in different
    orders for fused layers, and each Linear must find its own group in both."""
    blocks: dict[str, list[str]] = {}
    exact = []
    for name in names:
        head, sep, rest = name.partition(prefix + ".")
        index, _, inside = rest.partition(".")
        if head or not sep or not index.isdigit():
            exact.append(name)
            continue
        key = re.escape(re.sub(r"(?<=experts\.)\d+(?=\.)", "@", inside)).replace("@", r"\d+")
        if index not in blocks.setdefault(key, []):
            blocks[key].append(index)
    alternatives = {key: "|".join(sorted(idx, key=int)) for key, idx in blocks.items()}
    return exact + [f"re:^{re.escape(prefix)}\\.{f'(?:{alt})' if '|' in alt else alt}\\.{key}$"
                    for key, alt in alternatives.items()]


def group_for(qcfg: dict, module: str | None) -> dict:
    """The config group whose targets match Linear `module` as compressed-tensors matches them (an exact name, else a
    regex, else the class name); the first group without a module."""
    groups = [g for g in (qcfg.get("config_groups") or {}).values() if isinstance(g, dict)]
    if module is None or len(groups) == 1:
        return groups[0]
    for test in (lambda t: t == module, lambda t: t.startswith("re:") and re.match(t[3:], module) is not None,
                 lambda t: t == "Linear"):
        for g in groups:
            if any(test(t) for t in g.get("targets") or []):
                return g
    raise QuantkitError(f"quantization_config.config_groups: no group targets {module}")


_ROW_SCALE = Part(FLOATS, lambda d: [[d.out, 1], [1]])  # W8A8: per channel, or per tensor as llm-compressor writes
PARTS = {
    PACKED: {
        "weight_packed": Part(I32, lambda d: [[d.out, packed(d.cols, d.bits)]]),
        "weight_scale": Part(FLOATS, lambda d: [[d.out, d.groups]]),
        "weight_zero_point": Part(I32, lambda d: [[packed(d.out, d.bits), d.groups]], required=False),
        "weight_shape": Part(I64, lambda d: [[2]]),
        "weight_g_idx": Part(I32, lambda d: [[d.cols]], required=False),
    },
    INT: {"weight": Part((torch.int8,), lambda d: [[d.out, d.cols]]), "weight_scale": _ROW_SCALE},
    FLOAT: {"weight": Part((torch.float8_e4m3fn,), lambda d: [[d.out, d.cols]]),
            "weight_scale": Part((torch.float32,), _ROW_SCALE.shapes),
            "input_scale": Part((torch.float32,), lambda d: [[1]], required=False)},
}


def _block_scale(block: tuple[int, int]) -> Part:
    return Part((torch.float32,), lambda d: [[-(-d.out // block[0]), -(-d.cols // block[1])]])


class CompressedTensors(Format):
    name = "compressed-tensors"
    bits = (2, 3, 4, 8)
    kinds = ("int", "float", "fp4", "mxfp8")
    weight_only = False
    kv_cache = True
    mixed = True
    loaders = [
        ("vLLM / SGLang", "vllm serve {path}"),
        ("transformers (with compressed-tensors)", "AutoModelForCausalLM.from_pretrained('{path}')"),
    ]

    def encode(self, qweights, info: QuantInfo, dtype: torch.dtype) -> Encoded:
        # int scales are kept in the model's float dtype (FP8 scales stay float32); fp16-rounded values are exact in
        # float32 and float16 (bfloat16 would round them again, so those models get fp16 scales).
        return encode(qweights, info, torch.float32 if dtype == torch.float32 else torch.float16)

    def marker(self, qcfg: dict) -> str:
        return marker(qcfg)

    def decode(self, parts: dict[str, torch.Tensor], qcfg: dict, module: str | None = None) -> QuantizedTensor:
        return decode_module(parts, qcfg, module)

    def layout(self, qcfg: dict, module: str | None = None) -> Layout:
        kind = format_of(qcfg)
        block = block_of(qcfg) if kind == FLOAT else None
        if block:
            return Layout(kind, PARTS[kind] | {"weight_scale": _block_scale(block)}, 8, -1)
        if kind in ct_fp4.PRESET:
            return Layout(kind, ct_fp4.parts(kind), 4, ct_fp4.SPECS[ct_fp4.PRESET[kind]].group_size)
        if kind == ct_mxfp8.FORMAT:
            return Layout(kind, ct_mxfp8.PARTS, 8, 32)
        if kind == INT and int_grid(qcfg).bits == 4:  # W4AFP8
            spec = int_grid(qcfg)
            return Layout(kind, PARTS[kind] | {"weight_scale": Part(FLOATS, lambda d: [[d.out, d.groups]])}, 4,
                          spec.group_size)
        if kind != PACKED:
            return Layout(kind, PARTS[kind], 8, -1)
        w = group_for(qcfg, module)["weights"]
        return Layout(kind, PARTS[kind], int(w["num_bits"]), int(w.get("group_size") or -1))

    def activations(self, qcfg: dict) -> str | None:
        fmt = format_of(qcfg)
        if fmt == INT and int_grid(qcfg).bits == 4:
            return "fp8"  # W4AFP8
        if fmt == ct_mxfp8.FORMAT:  # MXFP8 with its inputs quantized, or MXFP8A16
            return "mxfp8" if _args(qcfg, "input_activations") else None
        if fmt in ct_fp4.PRESET:
            return ct_fp4.input_kind(_args(qcfg, "input_activations"), fmt)
        return {v: k for k, v in W8A8_FORMATS.items()}.get(fmt)

    def input_group(self, qcfg: dict) -> int | None:
        act = _args(qcfg, "input_activations")
        return int(act["group_size"]) if act.get("strategy") in ("group", "tensor_group") else None

    def weight_only_int(self, qcfg: dict) -> bool:
        """Groups of integer weights whose inputs stay unquantized."""
        return any(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "int"
                   and not g.get("input_activations") for g in qcfg.get("config_groups", {}).values())


register(CompressedTensors())
