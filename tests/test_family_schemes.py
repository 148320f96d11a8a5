"""Issue 41's schemes on every family: each compressed-tensors preset below, rounded to nearest on a tiny random
model of each family (MoE experts included), writes an artifact that quantkit's runtime reloads bit-exactly (logits equal
to the in-memory quantized model's, its inputs quantized as the preset says), with a logits error against the float
model far below the logits' own mean square (a broken layer's is of its size). Rows go to $QUANTKIT_MATRIX like tests/test_families.py's, for README's
scheme matrix (benchmarks/support_matrix.py). GPTQ on these grids, the peers' layouts and transformers' loading are
tested per scheme on the tiny llama (test_fp4*.py, test_mxfp8.py, test_w4afp8.py, test_fp8_schemes.py,
test_peer_layout.py)."""

from __future__ import annotations

import pytest
import torch
from test_families import FAMILIES, _quantize, record

from quantkit import runtime

SCHEMES = {  # matrix column -> the weight stage
    "NVFP4": "rtn: {scheme: NVFP4}",
    "MXFP4": "rtn: {scheme: MXFP4}",
    "MXFP8": "rtn: {scheme: MXFP8}",
    "W4AFP8": "rtn: {scheme: W4AFP8, group_size: 32}",  # the preset's 128 exceeds the tiny models' widths
    "FP8 static": "rtn: {scheme: FP8}",
}


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_scheme_reloads_bit_exactly(tiny_factory, arch, tmp_path):
    for scheme, stage in SCHEMES.items():
        case = _quantize(tiny_factory(arch), [stage], ["compressed-tensors"], tmp_path / scheme.replace(" ", "-"))
        with torch.no_grad():
            ours = case.model(case.tokens).logits
            again = runtime.load(str(case.folders["compressed-tensors"]), "float32").model(case.tokens).logits
        assert torch.equal(again, ours), f"{scheme}: runtime reload differs by {float((again - ours).abs().max())}"
        # an error of the scheme's size, not a broken model's (which is the logits' own size or more): below 30 % of
        # the logits' mean square (measured at most 21 %: MXFP4 on the tiny Gemma 3; 1-2 % on the Llama-like ones)
        scale = float(ours.square().mean())
        assert 0 < case.float_error < 0.3 * scale, (scheme, case.float_error, scale)
        record(family=arch, method=scheme, formats=["compressed-tensors"], runtime=["compressed-tensors"],
               transformers=[], error=case.float_error, relative_error=case.float_error / scale)
