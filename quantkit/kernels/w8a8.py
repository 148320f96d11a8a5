"""W8A8 Linear layers: int8 or FP8 weights with per-channel scales, activations quantized per token on the fly.

The arithmetic vLLM runs for compressed-tensors int-quantized / float-quantized checkpoints, in plain torch:
  int8: a token's scale is max|x| / 127 (vLLM's dynamic per-token int8 quant), codes multiply int8 x int8 -> int32
        (torch._int_mm on CUDA; on CPU exact float32 GEMMs over K-chunks, see int8_mm), and the int32 sums are rescaled by token scale x channel scale.
  FP8:  a token's scale is max|x| / 448 (floored at 1/(448·512) as vLLM does), e4m3 x e4m3 through
        torch._scaled_mm with those row / column scales on CUDA; elsewhere an emulation that dequantizes both
        operands to float32 and multiplies them. A static input scale (the FP8 preset) replaces the token scales;
        FP8_BLOCK's layer takes a scale per group of columns of each token and per weight block (emulated).
W4AFP8: int4 weights (a scale per group) with FP8 inputs per token, emulated in float32 (W4Fp8Linear); MXFP8:
e4m3 weights and inputs with power-of-two scales per 32 columns, emulated in float32 (Mxfp8Linear); NVFP4 / MXFP4:
e2m1 weights and inputs, emulated in float32 (Fp4Linear).
Each layer records in `path` which matmul its last forward ran.
"""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.fp4 import Fp4Weight
from ..algorithms.fp4 import fake_quantize_inputs as fake_quantize_fp4
from ..algorithms.fp8 import FP8_DTYPE, FP8_MAX, Fp8BlockWeight, Fp8Weight, fp8_quantize
from ..algorithms.grid import INT8_CHANNEL, QuantizedWeight
from ..algorithms.mxfp8 import Mxfp8Weight, fake_quantize_mx
from ..algorithms.scheme import QuantizedTensor
from ..algorithms.rtn import rtn_quantize
from ..errors import QuantkitError

INT8_MAX = 127
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512)  # vLLM's floor, so an all-zero token does not divide by zero


def quantize_tokens_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> int8 codes, float32 scales [tokens, 1]; x ≈ codes · scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    codes = torch.round(x / torch.where(scale == 0, 1.0, scale)).clamp(-INT8_MAX - 1, INT8_MAX)
    return codes.to(torch.int8), scale


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> float8_e4m3fn values, float32 scales [tokens, 1]; x ≈ values · scale."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static_fp8(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] on one calibrated scale [1] -> float8_e4m3fn values, that scale as [tokens, 1]."""
    scale = scale.float().to(x.device).reshape(1, 1)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.expand(x.shape[0], 1).contiguous()


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> float8_e4m3fn values, float32 scales [tokens, in / group]: each group of `group` columns of
    a token quantized like a token of quantize_tokens_fp8."""
    q, scale = quantize_tokens_fp8(x.reshape(-1, group))
    return q.reshape(x.shape), scale.reshape(x.shape[0], -1)


TOKEN_QUANTIZERS = {"int8": quantize_tokens_int8, "fp8": quantize_tokens_fp8}


def fake_quantize_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x with each token quantized and dequantized on the grid Int8Linear / Fp8Linear use (kind: int8 | fp8):
    what a float Linear holding the dequantized weight must read to compute what the W8A8 layer computes."""
    q, scale = TOKEN_QUANTIZERS[kind](x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).to(x.dtype).reshape(x.shape)


def fake_quantize_input(x: torch.Tensor, kind: str, group: int | None = None,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """fake_quantize_tokens, per group of `group` columns (FP8_BLOCK) or on a static scale (the FP8 preset); MXFP8's
    (kind mxfp8) per group of 32 columns with power-of-two scales; NVFP4's and MXFP4's (kind fp4) per group of
    `group` columns, NVFP4's over its static global scale."""
    if kind == "mxfp8":
        return fake_quantize_mx(x)
    if kind == "fp4":
        return fake_quantize_fp4(x, group, scale)
    if group is None and scale is None:
        return fake_quantize_tokens(x, kind)
    flat = x.reshape(-1, x.shape[-1])
    if scale is not None:
        q, s = quantize_static_fp8(flat, scale)
        return (q.float() * s).to(x.dtype).reshape(x.shape)
    q, s = quantize_groups_fp8(flat, group)
    return (q.float().reshape(-1, group) * s.reshape(-1, 1)).to(x.dtype).reshape(x.shape)


def int8_mm_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32, in float64: every partial sum is an integer below
    K·2^14 < 2^53, so it is exact on any device."""
    return (a.double() @ b.double()).to(torch.int32)


FP32_EXACT_K = 1024  # |a·b| <= 128·128 = 2^14 per product, so up to 1024 of them sum below 2^24: exact in float32


def int8_mm_fp32_chunked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32 through float32 GEMMs over K-chunks of at most 1024, each exact
    (integers below 2^24), summed in int32. On CPU this is ~15x faster than torch._int_mm, whose CPU kernel is a
    reference loop (SmolLM2 down_proj, 2048 tokens: 1.15 s vs 0.066 s), and bit-identical to it."""
    acc = None
    for k in range(0, a.shape[1], FP32_EXACT_K):
        part = (a[:, k : k + FP32_EXACT_K].float() @ b[k : k + FP32_EXACT_K].float()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


INT_MM_MIN_ROWS = 17  # torch's CUDA _int_mm (cuBLASLt) checks: M > 16, K and N multiples of 8


def int_mm_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm for any M: decode batches (M <= 16) are padded with zero rows to 32 and sliced back,
    so they run the int8 GEMM too (the zero rows add nothing to the other rows' sums)."""
    m = a.shape[0]
    if m >= INT_MM_MIN_ROWS:
        return torch._int_mm(a, b)
    padded = torch.zeros(32, a.shape[1], dtype=a.dtype, device=a.device)
    padded[:m] = a
    return torch._int_mm(padded, b)[:m]


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, str]:
    """a int8 [M, K] @ b int8 [K, N] -> exact int32 [M, N], and which path ran:
    '_int_mm' (cuBLASLt int8 GEMM), 'fp32-chunked' (CPU) or 'float64' (CUDA shapes cuBLASLt refuses; float64
    because CUDA float32 GEMMs may run in TF32)."""
    if a.device.type == "cpu":
        return int8_mm_fp32_chunked(a, b), "fp32-chunked"
    if a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0:
        return int_mm_padded(a, b), "_int_mm"
    return int8_mm_exact(a, b), "float64"


def _scaled_mm_takes(q: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> bool:
    # Row-wise scaled FP8 GEMM: SM89+, K and N multiples of 16, and bf16 output (the only output dtype every
    # torch release and GPU accepts for row-wise scales). Other dtypes run the emulation.
    return (
        q.is_cuda
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(q.device) >= (8, 9)
        and q.shape[1] % 16 == 0
        and w.shape[0] % 16 == 0
    )


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight.to(torch.int8).contiguous())  # [out, in]
        self.out_features, self.in_features = self.weight.shape  # as nn.Linear: FLOP counts read these
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1).contiguous())  # [1, out]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.path: str | None = None

    @classmethod
    def from_weights(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> Int8Linear:
        if qw.spec != INT8_CHANNEL:
            raise QuantkitError(f"weight: Int8Linear needs 8-bit symmetric per-channel codes, got {qw.spec}")
        return cls(qw.codes.to(torch.int16) - 128, qw.scale, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_weights(rtn_quantize(linear.weight.detach(), INT8_CHANNEL), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        codes, token_scale = quantize_tokens_int8(x.reshape(-1, x.shape[-1]))
        acc, self.path = int8_mm(codes, self.weight.t())
        out = acc.float() * token_scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*lead, -1)


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight.to(FP8_DTYPE).contiguous())  # [out, in]
        self.out_features, self.in_features = self.weight.shape  # as nn.Linear: FLOP counts read these
        # [1, out] (a per-tensor scale repeated: the row-wise GEMM and the emulation take it so)
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1).expand(1, self.out_features)
                             .contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # [1]: static input scale (the FP8 preset); None: per token at run time
        self.input_scale = None if input_scale is None else input_scale.float().reshape(1)
        self.path: str | None = None

    @classmethod
    def from_weights(cls, fw: Fp8Weight, bias: torch.Tensor | None = None) -> Fp8Linear:
        return cls(fw.weight, fw.scale, bias, fw.input_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        return cls.from_weights(fp8_quantize(linear.weight.detach()), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if self.input_scale is None:
            q, token_scale = quantize_tokens_fp8(flat)
        else:
            q, token_scale = quantize_static_fp8(flat, self.input_scale)
        if _scaled_mm_takes(q, self.weight, x.dtype):
            out = torch._scaled_mm(
                q, self.weight.t(), scale_a=token_scale, scale_b=self.weight_scale, out_dtype=torch.bfloat16
            ).float()
            self.path = "_scaled_mm"
        else:
            out = (q.float() * token_scale) @ (self.weight.float() * self.weight_scale.t()).t()
            self.path = "emulated"
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*lead, -1)


class Fp8BlockLinear(nn.Module):
    """FP8_BLOCK: FP8 weights with a scale per block, inputs quantized per group of `group` columns of each token
    (vLLM's per-token-group quant); emulated in float32 (the block-scaled GEMM is a GPU kernel)."""

    def __init__(self, fw: Fp8BlockWeight, group: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", fw.weight.contiguous())
        self.register_buffer("weight_scale", fw.scale.float().contiguous())
        self.block, self.group = fw.block, group
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.path: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, scale = quantize_groups_fp8(x.reshape(-1, x.shape[-1]), self.group)
        xs = (q.float().reshape(q.shape[0], -1, self.group) * scale[..., None]).reshape(q.shape)
        w = Fp8BlockWeight(self.weight, self.weight_scale, self.block).dequantize()
        out = xs @ w.t()
        self.path = "emulated"
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*lead, -1)


class W4Fp8Linear(nn.Module):
    """W4AFP8: int4 weights with a scale per group of columns, inputs quantized to FP8 per token at run time (the
    scale max|x| / 448, as Fp8Linear's); emulated in float32 on the dequantized weight (vLLM's W4A8-FP8 GEMM is a
    Hopper kernel)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", qw.dequantize(torch.float32))  # exact: int4 value x fp16 / fp32 scale
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.path: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, token_scale = quantize_tokens_fp8(x.reshape(-1, x.shape[-1]))
        out = (q.float() * token_scale) @ self.weight.t()
        self.path = "emulated"
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*lead, -1)


class Fp4Linear(nn.Module):
    """NVFP4 / MXFP4 with quantized inputs (W4A4): e2m1 weights, inputs e2m1-quantized per token and group at run
    time as compressed-tensors' forward_quantize does (NVFP4: over the calibrated input global scale); emulated in
    float32 (FP4 GEMMs are Blackwell kernels)."""

    def __init__(self, qw: Fp4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        if qw.spec.global_scale and qw.input_scale is None:
            raise QuantkitError("input_global_scale: missing; NVFP4 with quantized inputs needs each Linear's "
                                "input global scale")
        self.register_buffer("weight", qw.dequantize(torch.float32))
        self.register_buffer("input_scale", qw.input_scale)  # NVFP4's input global scale: moves with the layer
        self.group = qw.spec.group_size
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.path: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fake_quantize_fp4(x, self.group, self.input_scale).float() @ self.weight.t()
        self.path = "emulated"
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


class Mxfp8Linear(nn.Module):
    """MXFP8: e4m3 weights with a power-of-two scale per 32 columns, inputs quantized the same way per token and
    group of 32 columns at run time (compressed-tensors' dynamic MX input quantization); emulated in float32 (vLLM's
    MXFP8 GEMMs are GPU kernels)."""

    def __init__(self, qw: Mxfp8Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", qw.dequantize(torch.float32))  # exact: e4m3 x a power of two
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.path: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fake_quantize_mx(x.float()) @ self.weight.t()
        self.path = "emulated"
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


LAYERS = {"int": Int8Linear, "float": Fp8Linear}  # a W8A8 weight's scheme kind -> the layer that runs it


def w8a8_layer(qw: QuantizedTensor, bias: torch.Tensor | None, group: int | None) -> nn.Module:
    if isinstance(qw, Fp8BlockWeight):
        if group is None:
            raise QuantkitError("input_activations: FP8 block weights are run with inputs per group of columns")
        return Fp8BlockLinear(qw, group, bias)
    if isinstance(qw, QuantizedWeight) and qw.spec.bits == 4:
        return W4Fp8Linear(qw, bias)
    if isinstance(qw, Mxfp8Weight):
        return Mxfp8Linear(qw, bias)
    if isinstance(qw, Fp4Weight):
        return Fp4Linear(qw, bias)
    return LAYERS[qw.scheme.kind].from_weights(qw, bias)


def swap_w8a8_linears(model: nn.Module, qweights: dict[str, QuantizedTensor], group: int | None = None) -> None:
    """Replace each named nn.Linear by the W8A8 layer for its quantized weight (int8 codes or FP8), in place;
    the bias and the device are kept. group: columns per input scale (FP8_BLOCK), None: per token."""
    for name, qw in qweights.items():
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise QuantkitError(f"{name}: not an nn.Linear ({type(linear).__name__})")
        if tuple(qw.shape) != tuple(linear.weight.shape):
            raise QuantkitError(f"{name}: quantized weight {tuple(qw.shape)} does not fit {tuple(linear.weight.shape)}")
        try:
            layer = w8a8_layer(qw, linear.bias, group).to(linear.weight.device)
        except QuantkitError as err:
            raise QuantkitError(f"{name}.{err}") from None
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
