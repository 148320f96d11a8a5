"""W4A16 Linear layers on real 4-bit kernels, for the bench: PyTorch's int4 weight-only kernels (tinygemm), or on
x86 CPUs quantkit's own AVX2 kernel (kernels/int4_cpu.py), which beats both there.

backend "torch":

`_weight_int4pack_mm` (CUDA) and `_weight_int4pack_mm_for_cpu` compute x @ W.T with W stored as 4-bit codes,
one (scale, zero) pair per group of `group_size` input columns, dequantized on the fly as
    w = (q - 8) · scale + zero
so GPTQ / AWQ / compressed-tensors' integer zero point z becomes the float zero (8 - z) · scale. Their
activations are bfloat16: the CPU kernel's vectorized (AVX2 / AVX512) path takes only bfloat16 inputs (float32
inputs fall back to a scalar loop ~10x slower than an fp32 F.linear), and the CUDA kernel only bfloat16. So the
layer casts its input to bfloat16 and its output back; scales and zeros are bfloat16 too (the kernels' dtype),
which moves a dequantized weight by at most 2^-9 of its group's scale — 1/32 of a 4-bit step.

backend "quantkit" (CPU): float32 activations, float32 scales and integer zero points, w = (q - z) · scale exactly
as the artifact stores it; see int4_cpu.py.

Act-order checkpoints (a non-trivial g_idx) are repacked at load: columns are sorted by group so every group is
contiguous again, and the layer gathers the input columns in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.grid import QuantizedWeight
from ..errors import QuantkitError

CUDA_INNER_K_TILES = 8  # tinygemm's widest K tile: K must be a multiple of 8·16 = 128 on CUDA
CPU_INNER_K_TILES = 2  # the CPU layout ignores it beyond validation


BACKENDS = ("auto", "torch", "quantkit")


def pick_backend(name: str, device: torch.device) -> str:
    """auto: quantkit's AVX2 kernel on a CPU that can build and run it, PyTorch's int4 kernel everywhere else."""
    from . import int4_cpu

    if name not in BACKENDS:
        raise QuantkitError(f"int4 kernel: backend '{name}' is not one of {', '.join(BACKENDS)}")
    if device.type == "cuda" and name == "quantkit":
        raise QuantkitError("int4 kernel: quantkit's kernel is CPU-only (AVX2); on CUDA use torch or auto")
    if device.type == "cuda" or name == "torch":
        return "torch"
    ok, why = int4_cpu.available()
    if name == "quantkit" and not ok:
        raise QuantkitError(why)
    return "quantkit" if ok else "torch"


def kernel_name(device: torch.device, backend: str = "torch") -> str:
    if backend == "quantkit":
        return "quantkit.int4_gemm (AVX2)"
    return "aten._weight_int4pack_mm" if device.type == "cuda" else "aten._weight_int4pack_mm_for_cpu"


def supports(qw: QuantizedWeight, device: torch.device, backend: str = "torch") -> str | None:
    """Why this weight cannot run on the int4 kernel on `device`, or None when it can."""
    out, cols = qw.shape
    if qw.spec.bits != 4:
        return f"{qw.spec.bits}-bit weights (the int4 kernel needs 4)"
    if backend == "quantkit":
        span = qw.spec.span(cols)
        return None if cols % 16 == 0 and span % 16 == 0 else f"in_features {cols} / group {span} not multiples of 16"
    span = qw.spec.span(cols)
    if span not in (32, 64, 128, 256) and qw.spec.group_size != -1:
        return f"group size {qw.spec.group_size} (the int4 kernel takes 32, 64, 128 or 256)"
    if device.type == "cuda":
        if cols % (CUDA_INNER_K_TILES * 16) or out % 8:
            return f"shape [{out}, {cols}] (CUDA tinygemm needs in_features % 128 == 0, out_features % 8 == 0)"
        if qw.spec.group_size == -1:
            return "per-channel scales on CUDA (tinygemm needs groups of 32..256)"
    elif out % 16 or cols % 2:
        return f"shape [{out}, {cols}] (the CPU kernel needs out_features % 16 == 0 and even in_features)"
    elif qw.spec.group_size == -1 and cols % 32:
        return f"per-channel scales with in_features {cols} (the CPU kernel repeats them over groups of 32..256)"
    return None


def group_order(qw: QuantizedWeight) -> torch.Tensor | None:
    """The column permutation that makes act-order groups contiguous (None when they already are)."""
    if qw.g_idx is None:
        return None
    perm = torch.argsort(qw.g_idx.long(), stable=True)
    counts = torch.bincount(qw.g_idx.long(), minlength=qw.scale.shape[1])
    if not torch.all(counts == qw.spec.span(qw.shape[1])):
        raise QuantkitError(f"g_idx: groups of unequal size {counts.unique().tolist()} cannot be made contiguous")
    return perm


class W4Linear(nn.Module):
    """nn.Linear replacement running a 4-bit QuantizedWeight through an int4 kernel (see the module docstring)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, backend: str = "torch"):
        super().__init__()
        reason = supports(qw, device, backend)
        if reason:
            raise QuantkitError(f"int4 kernel: {reason}")
        self.backend = backend
        self.out_features, self.in_features = qw.shape
        perm = group_order(qw)
        codes = qw.codes if perm is None else qw.codes[:, perm]
        self.register_buffer("perm", perm.to(device) if perm is not None else None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        if backend == "quantkit":
            from . import int4_cpu

            self.group_size = qw.spec.span(self.in_features)
            self.register_buffer("weight", int4_cpu.pack(codes).to(device))
            self.register_buffer("scales", qw.scale.float().contiguous().to(device))
            self.register_buffer("zeros", qw.zero.float().contiguous().to(device))
            return
        # per-channel = one group spanning the row; the kernel wants a power-of-two group, so repeat the scale
        self.group_size = qw.spec.group_size if qw.spec.group_size != -1 else self._channel_group(self.in_features)
        repeat = self.in_features // self.group_size // qw.scale.shape[1]
        scale = qw.scale.float().repeat_interleave(repeat, dim=1)  # [out, groups]
        zero = (8 - qw.zero.float().repeat_interleave(repeat, dim=1)) * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale.T, zero.T], dim=-1).to(device, torch.bfloat16))
        self.register_buffer("weight", self._pack(codes.to(device)))

    @staticmethod
    def _channel_group(cols: int) -> int:
        for g in (256, 128, 64, 32):
            if cols % g == 0:
                return g
        raise QuantkitError(f"int4 kernel: in_features {cols} is not a multiple of 32")

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.is_cuda:  # [out, in/2] uint8, even column in the high nibble (torchao's tinygemm packing)
            pairs = codes.to(torch.uint8)
            return torch.ops.aten._convert_weight_to_int4pack((pairs[:, ::2] << 4) | pairs[:, 1::2], CUDA_INNER_K_TILES)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), CPU_INNER_K_TILES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:
            flat = flat[:, self.perm]
        if self.backend == "quantkit":
            from .int4_cpu import int4_gemm

            y = int4_gemm(flat, self.weight, self.scales, self.zeros, self.group_size)
        else:
            flat = flat.to(torch.bfloat16).contiguous()
            mm = torch.ops.aten._weight_int4pack_mm if flat.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
            y = mm(flat, self.weight, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"act_order={self.perm is not None}, backend={self.backend}")


def swap_w4a16_linears(model: nn.Module, qweights: dict[str, QuantizedWeight], device: torch.device,
                       backend: str = "torch") -> list[str]:
    """Replace each named nn.Linear by a W4Linear on `device`, in place. Returns the names (with reasons) that the
    kernel cannot take; those keep their dequantized float weight."""
    skipped = []
    for name, qw in qweights.items():
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise QuantkitError(f"{name}: not an nn.Linear ({type(linear).__name__})")
        reason = supports(qw, device, backend)
        if reason:
            skipped.append(f"{name}: {reason}")
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, W4Linear(qw, linear.bias, device, backend))
    return skipped
