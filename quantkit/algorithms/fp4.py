"""FP4 (e2m1) weights with a scale per group of columns: compressed-tensors' NVFP4A16 and MXFP4A16 presets.

NVFP4: groups of 16, float8_e4m3 group scales, one float32 global scale per weight; the group's effective scale is
scale / global_scale. MXFP4: groups of 32, power-of-two group scales stored as e8m0 exponents (uint8, bias 127),
no global scale. The scales, the global scale and the rounding to the e2m1 grid are compressed-tensors' own
functions (calculate_qparams, generate_gparam; cast_to_fp4's rounding, bit for bit), fed the min and max of each group in the weight's
dtype as llm-compressor's observer does, so a round-to-nearest weight is what compressed-tensors' fake_quantize
gives on it, bit for bit (tests/test_fp4.py).

NVFP4's global scale is shared by the Linears a loader runs as one (q/k/v, gate/up: FUSED, llm-compressor's
FUSED_LAYER_NAMES): vLLM keeps one global scale per fused layer (the largest of its shards'), so each member's
group scales must be made over the same one, taken from the members' float weights together (`fuse`,
`global_scale_for`).

Codes are one e2m1 value per byte here (sign << 3 | magnitude index, the nibble compressed-tensors packs), so the
packers, the resume checkpoint and parking handle them as the int kinds' codes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

from .grid import row_steps
from .scheme import QuantizedTensor, Scheme

FP4_MAX = 6.0
# e2m1 magnitudes by index; a code's bit 3 is its sign (a code 8 is -0, as compressed-tensors packs a negative
# value rounded to zero)
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
VALUES = torch.cat([MAGNITUDES, -MAGNITUDES])
_INDEX_OF_TWICE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)  # 2·|v| -> index


@dataclass(frozen=True)
class Fp4Spec:
    """The FP4 grid of a preset; bits, group_size and sym read as a GridSpec's do (formats and messages ask them)."""

    preset: str  # NVFP4A16 | MXFP4A16: compressed-tensors' preset, whose weight arguments it is
    group_size: int
    bits: int = 4
    sym: bool = True

    @property
    def args(self) -> QuantizationArgs:
        return PRESET_ARGS[self.preset]

    @property
    def global_scale(self) -> bool:
        return self.preset == "NVFP4A16"

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.args.scale_dtype

    def span(self, in_features: int) -> int:
        return self.group_size

    def groups(self, in_features: int) -> int:
        return in_features // self.group_size

    @property
    def scheme(self) -> Scheme:
        return Scheme("fp4", 4, self.group_size, True, self.scale_dtype, global_scale=self.global_scale)


PRESET_ARGS = {"NVFP4A16": NVFP4A16["weights"], "MXFP4A16": MXFP4A16["weights"]}
SPECS = {name: Fp4Spec(name, args.group_size) for name, args in PRESET_ARGS.items()}


def spec_for(group_size: int) -> Fp4Spec:
    """16: NVFP4, 32: MXFP4, as compressed-tensors' compressors tell them apart."""
    return next(s for s in SPECS.values() if s.group_size == group_size)


@dataclass
class Fp4Weight(QuantizedTensor):
    kind = "fp4"
    codes: torch.Tensor  # uint8 [out, in], one e2m1 code each
    scale: torch.Tensor  # [out, groups]: float8_e4m3fn (NVFP4) | uint8 e8m0 exponents (MXFP4)
    spec: Fp4Spec
    global_scale: torch.Tensor | None = None  # float32 [1] (NVFP4)
    # float32 [1]: the static input scale of NVFP4 with quantized inputs, its inputs' global scale (compressed-tensors'
    # input_global_scale), calibrated from the data
    input_scale: torch.Tensor | None = None

    @property
    def scheme(self) -> Scheme:
        return self.spec.scheme

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        t = {"codes": self.codes, "scale": self.scale, "global_scale": self.global_scale,
             "input_scale": self.input_scale}
        return {k: v for k, v in t.items() if v is not None}

    def meta(self) -> dict:
        return {"kind": self.kind, "preset": self.spec.preset}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> Fp4Weight:
        return cls(tensors["codes"], tensors["scale"], SPECS[meta["preset"]], tensors.get("global_scale"),
                   tensors.get("input_scale"))

    def effective_scale(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [rows, groups]: what a code's value is multiplied by (compressed-tensors' scale / global_scale)."""
        return effective(self.scale[rows], self.global_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, cols = self.codes.shape
        w = torch.empty(out, cols, dtype=dtype, device=self.codes.device)
        for r in row_steps(out, cols):
            values = VALUES.to(self.codes.device)[self.codes[r].long()]
            scale = self.effective_scale(r)
            w[r] = (values.view(values.shape[0], scale.shape[1], -1) * scale[..., None]).view(-1, cols).to(dtype)
        return w


def effective(stored: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    if stored.dtype == torch.uint8:
        return decompress_mx_scale(stored).float()
    scale = stored.float()
    return scale if global_scale is None else scale / global_scale.float()


def store(scale: torch.Tensor, spec: Fp4Spec) -> torch.Tensor:
    """A group scale from calculate_qparams as the artifact keeps it (compressed-tensors' _compress_scale)."""
    return compress_mx_scale(scale, torch.uint8) if spec.scale_dtype == torch.uint8 else scale.to(spec.scale_dtype)


def global_scale_of(weight: torch.Tensor, spec: Fp4Spec) -> torch.Tensor | None:
    """NVFP4's float32 [1] global scale from the whole weight's min and max (llm-compressor's observer, unfused)."""
    if not spec.global_scale:
        return None
    lo, hi = torch.aminmax(weight)
    return generate_gparam(lo.reshape(1), hi.reshape(1))


# Linears a loader fuses into one layer, by their names under one parent (llm-compressor's FUSED_LAYER_NAMES)
FUSED = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))


@dataclass
class _Fused:
    members: list[weakref.ref]  # the Linears of one fused layer
    scale: torch.Tensor | None = None  # their global scale, once asked (from their float weights)


_FUSED: weakref.WeakKeyDictionary[nn.Module, _Fused] = weakref.WeakKeyDictionary()  # a run's Linear -> its group


def fuse(targets: dict[str, nn.Module]) -> None:
    """Registers the fused layers among a run's targets (by name), two or more members each."""
    groups: dict[tuple[str, tuple[str, ...]], list[nn.Module]] = {}
    for name, module in targets.items():
        parent, _, leaf = name.rpartition(".")
        for names in FUSED:
            if leaf in names:
                groups.setdefault((parent, names), []).append(module)
    for members in groups.values():
        if len(members) > 1:
            group = _Fused([weakref.ref(m) for m in members])
            for m in members:
                _FUSED[m] = group


def global_scale_for(module: nn.Module, spec: Fp4Spec) -> torch.Tensor | None:
    """The global scale module's weight is quantized over: its fused layer's, made from every member's weight at
    the first member's quantization (none is quantized yet then: the members are rounded, or solved, together or
    one after another before any of them runs), else its own."""
    if not spec.global_scale:
        return None
    group = _FUSED.get(module)
    if group is None:
        return global_scale_of(module.weight.data, spec)
    if group.scale is None:
        ranges = torch.stack([torch.stack(torch.aminmax(ref().weight.data)) for ref in group.members])
        group.scale = generate_gparam(ranges[:, 0].min().reshape(1), ranges[:, 1].max().reshape(1))
    return group.scale.clone()  # each weight's own tensor: safetensors refuses tensors that share memory


def group_scales(groups: torch.Tensor, spec: Fp4Spec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """calculate_qparams' scale of each row of groups [..., group_size] (in their dtype), global_scale broadcast
    against the groups' leading dims."""
    lo, hi = torch.aminmax(groups, dim=-1)
    scale, _ = calculate_qparams(lo, hi, spec.args, global_scale=global_scale)
    return scale


def scales_of_range(lo: torch.Tensor, hi: torch.Tensor, spec: Fp4Spec,
                    global_scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 scale each group is rounded with, from its min and max: calculate_qparams' scale as the artifact
    stores it (e4m3 over the global scale, or e8m0), read back."""
    scale, _ = calculate_qparams(lo, hi, spec.args, global_scale=global_scale)
    return effective(store(scale, spec), global_scale)


def round_values(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e2m1 values of w / scale (float32), clamped and rounded as compressed-tensors' quantize does: its
    cast_to_fp4, bit for bit (-0 where a negative value rounds to zero; tested). e2m1's steps are 0.5 below 2, 1
    below 4 and 2 up to 6, so a value is its quotient by its step rounded half to even, times the step (exact:
    the steps are powers of two); cast_to_fp4's eight masked writes give the same (~10x slower: GPTQ rounds a
    column at a time, and W4A4 every input)."""
    x = torch.clamp(w.float() / scale, -FP4_MAX, FP4_MAX)
    a = x.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    magnitude = torch.round(a / step) * step
    return torch.where(x < 0, -magnitude, magnitude)  # torch.sign: -0.0 stays +0


def codes_of(values: torch.Tensor) -> torch.Tensor:
    """uint8 codes of e2m1 values (the sign bit of -0 kept, as pack_fp4_to_uint8 keeps it)."""
    twice = (values.abs() * 2).to(torch.int64)
    return _INDEX_OF_TWICE.to(values.device)[twice] | (torch.signbit(values).to(torch.uint8) << 3)


def fake_quantize_inputs(x: torch.Tensor, group: int, global_scale: torch.Tensor | None) -> torch.Tensor:
    """x with each token's groups of `group` columns e2m1-quantized and dequantized as compressed-tensors'
    forward_quantize does NVFP4's (dynamic local scales over the static global scale) and MXFP4's (dynamic) input:
    the same calculate_qparams of each group's min and max as a weight's (tests/test_fp4_inputs.py). fp4_rtn's
    values times their scale, without its codes (half the time)."""
    spec = spec_for(group)
    groups = x.unflatten(-1, (-1, group))  # (an expert no token reached: zero rows)
    if global_scale is not None:
        global_scale = global_scale.to(x.device)
    scale = effective(store(group_scales(groups, spec, global_scale), spec), global_scale)[..., None]
    return (round_values(groups, scale) * scale).to(x.dtype).reshape(x.shape)


def fp4_rtn(weight: torch.Tensor, spec: Fp4Spec, global_scale: torch.Tensor | None = None) -> Fp4Weight:
    """Round to nearest: each group's scale from its own min and max over the global scale (NVFP4; default: from the
    whole weight's min and max)."""
    out, cols = weight.shape
    groups = spec.groups(cols)
    gs = global_scale_of(weight, spec) if global_scale is None else global_scale
    codes = torch.empty(out, cols, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out, groups, dtype=spec.scale_dtype, device=weight.device)
    for r in row_steps(out, cols):
        w = weight[r].reshape(-1, groups, spec.group_size)
        s = group_scales(w, spec, gs)
        stored = store(s, spec)
        eff = effective(stored, gs)
        codes[r] = codes_of(round_values(w, eff[..., None])).reshape(-1, cols)
        scale[r] = stored
    return Fp4Weight(codes, scale, spec, gs)
