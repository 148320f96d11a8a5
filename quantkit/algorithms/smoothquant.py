"""SmoothQuant (Xiao et al., 2022, arXiv:2211.10438): divide each input channel j of a group of Linears by
s_j = max|X_j|^α / max|W_:,j|^(1-α) and multiply their weight columns by it (smoothing.fold), so the few
outlier channels of LLM activations stop setting every token's int8 step; α moves difficulty to the weights.

Mappings are the norm -> Linears pairs only (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up;
OPT's self_attn_layer_norm -> q/k/v, final_layer_norm -> fc1): llm-compressor's DEFAULT_SMOOTHQUANT_MAPPINGS
and the paper's. The inputs of o_proj / down_proj come from no foldable norm and stay as they are.

Scales follow llm-compressor's SmoothQuantModifier (`_calculate_smoothing_scales`): max|W| over the
concatenated Linears' columns, activation scale kept where a column is all zero, and every scale floored
at 1e-5. Statistics are abs maxima, as in the paper and mit-han-lab/smoothquant; llm-compressor's
(max - min) range and 2·max|W| change every s_j by the same factor, which neither per-token activation
scales nor per-channel weight scales see.
"""

from __future__ import annotations

import torch

MIN_SCALE = 1e-5  # llm-compressor's MINIMUM_SMOOTHING_SCALE


@torch.no_grad()
def channel_absmax(x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """max |x| per input channel over all tokens, in float32 (chunked: no float copy of x)."""
    x = x.reshape(-1, x.shape[-1])
    out = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    for part in x.split(chunk):
        out = torch.maximum(out, part.abs().amax(0).float())
    return out


@torch.no_grad()
def smoothing_scale(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] for Linears reading the same input: max|X_j|^α / max|W_:,j|^(1-α), float32, ≥ MIN_SCALE."""
    x_absmax = x_absmax.float().flatten()
    w_absmax = torch.cat([w.detach().abs().float().to(x_absmax.device) for w in weights]).amax(0)
    s = x_absmax.pow(alpha) / w_absmax.pow(1 - alpha)
    s = torch.where(w_absmax > 0, s, x_absmax)  # a dead column: the weights cannot take any range
    return s.clamp(min=MIN_SCALE)
