"""Independent reference readers (plain torch) for quantized checkpoints.

Written from the upstream sources only, not from quantkit:

GPTQ (AutoGPTQ / GPTQModel layout)
  - AutoGPTQ/AutoGPTQ  auto_gptq/nn_modules/qlinear/qlinear_cuda.py and
    qlinear_cuda_old.py: ``QuantLinear.pack`` (numpy pack loop, 2/3/4/8 bits,
    ``zeros -= 1`` before packing) and the torch fallback in ``forward``
    (``wf`` shift tables, 3-bit word stitching, ``zeros + 1``).
  - ModelCloud/GPTQModel  gptqmodel/utils/model.py
    (``convert_gptq_v1_to_v2_format_module``: v1 stores zero-1, v2 stores zero),
    gptqmodel/quantization/config.py (``checkpoint_format`` / ``format`` fields;
    ``dynamic_get`` / ``_resolve_dynamic_override``: per-module ``dynamic`` rules),
    and its safetensors dequantizer (``unpack_rows``/``_unpack_rows_3bit``,
    ``_correct_gptq_v1_qzeros``).
compressed-tensors ``pack-quantized``
  - vllm-project/compressed-tensors (installed 0.20.1)
    compressed_tensors/compressors/pack_quantized/helpers.py (``pack_to_int32``,
    dense cross-word packing, +2**(bits-1) offset), .../pack_quantized/base.py
    (``weight_packed``/``weight_scale``/``weight_zero_point`` packed_dim=0/
    ``weight_shape``), quantization/lifecycle/forward_helpers.py
    (``_process_group``: g_idx permutation, ``_dequantize``: (q - zp) * scale).
    Older releases packed 32//bits values per word (no cross-word split); read too.
AutoAWQ GEMM
  - casper-hansen/AutoAWQ  awq/modules/linear/gemm.py (``from_linear`` pack loop,
    order_map [0,2,4,6,1,3,5,7]) and awq/utils/packing_utils.py
    (``unpack_awq``, ``reverse_awq_order`` [0,4,1,5,2,6,3,7], ``dequantize_gemm``).

Key fact used below: AutoGPTQ's 3-bit layout (32 values in 3 int32 words) is
exactly a dense little-endian bit stream -- value k of a 32-value block sits at
bit 3*k of ``w0 | w1 << 32 | w2 << 64`` -- the same rule compressed-tensors uses
for every bit width, and for 2/4/8 bits it reduces to "value j at bit bits*j".
"""

import glob
import json
import os
import re

import torch
from safetensors.torch import load_file

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # inverse of AWQ pack order [0,2,4,6,1,3,5,7]


def _load_tensors(folder):
    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(path))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return tensors


def _load_json(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _prefixes(tensors, suffix):
    return sorted(k[: -len(suffix)] for k in tensors if k.endswith(suffix))


def _unpack_dense(words, bits, n=None):
    """Unpack int32 words along the last dim: value k of each block of 32 values
    lives at bit bits*k of the little-endian concatenation of ``bits`` words."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    pad = (-u.shape[-1]) % bits
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(*u.shape[:-1], -1, bits)
    mask = (1 << bits) - 1
    vals = []
    for k in range(32):
        w, off = divmod(k * bits, 32)
        v = u[..., w] >> off
        if off + bits > 32:
            v = v | (u[..., w + 1] << (32 - off))
        vals.append(v & mask)
    out = torch.stack(vals, dim=-1).reshape(*u.shape[:-2], -1)
    return out if n is None else out[..., :n]


def _unpack_per_word(words, bits, n=None):
    """Legacy layout: 32//bits values per word, value j at bit bits*j, spare high bits."""
    per = 32 // bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    out = ((u.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*u.shape[:-1], -1)
    return out if n is None else out[..., :n]


# --------------------------------------------------------------------------- GPTQ
def gptq_dynamic(cfg, module):
    """GPTQModel quantization/config.py ``dynamic_get`` / vLLM gptq_utils.py
    ``get_dynamic_override``: the first ``dynamic`` rule, in order, whose regex
    (less its '+:' / '-:') ``re.match``-es the module name (start-anchored
    only); '-:' leaves the module float (False), '+:' (or none) overrides the
    top-level keys with its dict; no rule: {}."""
    for pattern, rule in (cfg.get("dynamic") or {}).items():
        raw = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        if re.match(raw, module):
            return False if pattern.startswith("-:") else rule
    return {}


def read_gptq(folder):
    cfg = dict(_load_json(folder, "config.json").get("quantization_config") or {})
    cfg.update(_load_json(folder, "quantize_config.json"))
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    v1 = fmt != "gptq_v2"
    tensors = _load_tensors(folder)
    out = {}
    for p in _prefixes(tensors, ".qweight"):
        rule = gptq_dynamic(cfg, p)
        assert rule is not False, f"{p} is stored quantized but a '-:' rule leaves it float"
        bits = int(rule.get("bits", cfg.get("bits", 4)))
        assert bits in (2, 3, 4, 8), bits
        qweight, qzeros = tensors[p + ".qweight"], tensors[p + ".qzeros"]
        scales = tensors[p + ".scales"].float()
        assert qweight.dtype == torch.int32 and qzeros.dtype == torch.int32
        n_in, n_out = qweight.shape[0] * 32 // bits, qweight.shape[1]
        assert scales.shape[1] == n_out and qzeros.shape[1] * 32 // bits == n_out
        # qweight packed along dim 0 (input): unpack the transposed tensor.
        q = _unpack_dense(qweight.t(), bits).t()  # [in, out]
        z = _unpack_dense(qzeros, bits)  # [groups, out]
        if v1:
            # AutoGPTQ: mask the field, then +1 (no re-mask). Agrees with GPTQModel's
            # (field + 1) & mask / word-wise +0x..0101 for every true zero in 1..2**bits-1.
            z = z + 1
        if p + ".g_idx" in tensors:
            g_idx = tensors[p + ".g_idx"].long()
        else:
            gs = int(rule.get("group_size", cfg.get("group_size", -1)))
            g_idx = torch.arange(n_in) // (n_in if gs == -1 else gs)
        assert g_idx.shape == (n_in,) and int(g_idx.max()) < scales.shape[0]
        w = scales[g_idx] * (q - z[g_idx]).float()  # [in, out]
        out[p] = w.t().contiguous()
    return out


# --------------------------------------------------------------- compressed-tensors
def _ct_scheme(qcfg, prefix):
    """Pick the config group whose targets match ``prefix`` (regex 're:' or a
    name/suffix); a class-name target such as 'Linear' matches any module."""
    fallback = None
    for group in qcfg["config_groups"].values():
        for t in group.get("targets", []):
            if t.startswith("re:"):
                if re.match(t[3:], prefix):
                    return group
            elif t == prefix or prefix.endswith("." + t):
                return group
            elif fallback is None:
                fallback = group
    assert fallback is not None, f"no config group for {prefix}"
    return fallback


def read_compressed_tensors(folder):
    qcfg = _load_json(folder, "config.json")["quantization_config"]
    tensors = _load_tensors(folder)
    out = {}
    for p in _prefixes(tensors, ".weight_packed"):
        group = _ct_scheme(qcfg, p)
        assert (group.get("format") or qcfg.get("format")) == "pack-quantized"
        wa = group["weights"]
        bits, strategy = int(wa["num_bits"]), wa["strategy"]
        assert wa.get("type", "int") == "int" and strategy in ("group", "channel", "tensor")
        offset = 1 << (bits - 1)
        packed = tensors[p + ".weight_packed"]
        scale = tensors[p + ".weight_scale"].float()
        assert packed.dtype == torch.int32
        n_out, n_in = (int(x) for x in tensors[p + ".weight_shape"].tolist())
        width = packed.shape[1]
        if width == -(-n_in * bits // 32):  # current: dense cross-word packing
            q = _unpack_dense(packed, bits, n_in)
        elif width == -(-n_in // (32 // bits)):  # legacy: 32//bits values per word
            q = _unpack_per_word(packed, bits, n_in)
        else:
            raise ValueError(f"{p}: weight_packed width {width} does not fit in={n_in}")
        q = q - offset  # signed values in [-2**(bits-1), 2**(bits-1)-1]
        if scale.ndim < 2:
            scale = scale.reshape(-1, 1)
        n_groups = scale.shape[1]
        if p + ".weight_zero_point" in tensors and not wa.get("symmetric", True):
            zp_packed = tensors[p + ".weight_zero_point"]  # packed along dim 0 (out)
            unpack = _unpack_dense if zp_packed.shape[0] == -(-n_out * bits // 32) else _unpack_per_word
            zp = unpack(zp_packed.t(), bits, n_out).t() - offset  # [out, groups]
        else:
            zp = torch.zeros(n_out, n_groups, dtype=torch.int64)
        if p + ".weight_g_idx" in tensors:  # actorder=group (older releases)
            g_idx = tensors[p + ".weight_g_idx"].long()
        elif strategy == "group":
            g_idx = torch.arange(n_in) // int(wa["group_size"])
        else:
            g_idx = torch.zeros(n_in, dtype=torch.long)
        scale = scale.expand(n_out, n_groups) if scale.shape[0] == 1 else scale
        zp = zp.expand(n_out, n_groups) if zp.shape[0] == 1 else zp
        out[p] = ((q - zp[:, g_idx]).float() * scale[:, g_idx]).contiguous()
    return out


# ------------------------------------------------------------------ AutoAWQ GEMM
def _unpack_awq(t):
    """Nibble i of word c holds column c*8 + [0,2,4,6,1,3,5,7][i]."""
    v = _unpack_per_word(t, 4).reshape(t.shape[0], -1, 8)
    return v[..., AWQ_REVERSE_ORDER].reshape(t.shape[0], -1)


def read_awq_gemm(folder):
    cfg = dict(_load_json(folder, "config.json").get("quantization_config") or {})
    cfg.update(_load_json(folder, "quant_config.json"))
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    assert bits == 4 and str(cfg.get("version", "gemm")).lower() == "gemm", cfg
    tensors = _load_tensors(folder)
    out = {}
    for p in _prefixes(tensors, ".qweight"):
        qweight, qzeros = tensors[p + ".qweight"], tensors[p + ".qzeros"]
        scales = tensors[p + ".scales"].float()  # [groups, out]
        n_in, n_out = qweight.shape[0], qweight.shape[1] * 8
        q, z = _unpack_awq(qweight), _unpack_awq(qzeros)  # true zero stored as is
        g_idx = torch.arange(n_in) // (n_in // scales.shape[0])
        assert scales.shape[1] == n_out and z.shape == scales.shape
        out[p] = ((q - z[g_idx]).float() * scales[g_idx]).t().contiguous()
    return out
