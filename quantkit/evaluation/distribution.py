"""How far a model's next-token distributions moved from the original's, per token (pure tensor math).

The statistics are the ones llama.cpp's `perplexity --kl-divergence` made the standard:
  KLD       KL(P_base || P_model) = sum_v p_v (ln p_v - ln q_v), in nats, per predicted token
  same top  argmax_v q_v == argmax_v p_v
  delta p   q(correct token) - p(correct token), as a fraction (llama.cpp prints percent)
  ln ratio  ln(PPL_model / PPL_base) = mean over tokens of (nll_model - nll_base)

The base side is kept only as its top-k log-probabilities (see `BaseTopK`): the KLD is then computed
between the two distributions coarsened to those k tokens plus one bucket for all the others. That is
exact when k covers the vocabulary and otherwise a lower bound (coarsening cannot increase a KL
divergence); `tail_mass` reports how much base probability the bucket held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

# log10-spaced histogram edges of per-token KLD for plots: [0, 1e-6), [1e-6, 1e-5.75) ... [1e2, inf)
HIST_EDGES = [0.0] + [10 ** (e / 4) for e in range(-24, 9)] + [math.inf]


def _rest_mass(logp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Probability outside the `idx` tokens, summed directly (1 - sum(top) would cancel to noise)."""
    return logp.exp().scatter_(-1, idx.long(), 0.0).sum(-1)


@dataclass
class BaseTopK:
    """What is kept of the original model's prediction at each scored position."""
    topk_logp: torch.Tensor  # [T, k] float32, descending
    topk_idx: torch.Tensor  # [T, k] int32
    rest: torch.Tensor  # [T] float32, probability of all tokens outside the top k
    target_logp: torch.Tensor  # [T] float32, log-prob of the token that actually follows

    @classmethod
    def from_logits(cls, logits: torch.Tensor, targets: torch.Tensor, k: int) -> "BaseTopK":
        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return cls(vals.contiguous(), idx.to(torch.int32), _rest_mass(logp, idx),
                   logp.gather(-1, targets[:, None])[:, 0].contiguous())

    def to(self, device) -> "BaseTopK":
        return BaseTopK(*(t.to(device) for t in (self.topk_logp, self.topk_idx, self.rest, self.target_logp)))


def token_stats(base: BaseTopK, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token KLD, same-top flag, delta p and both NLLs for one window. `logits`: the model's [T, V]."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    p_logp = base.topk_logp.double()
    q_logp = logq.gather(-1, base.topk_idx.long()).double()
    p_rest, q_rest = base.rest.double(), _rest_mass(logq, base.topk_idx).double()
    rest_term = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.clamp_min(1e-300).log()),
                            torch.zeros_like(p_rest))
    kld = (p_logp.exp() * (p_logp - q_logp)).sum(-1) + rest_term
    q_target = logq.gather(-1, targets[:, None])[:, 0]
    return {
        "kld": kld.clamp_min(0.0).float(),  # tiny negatives are float rounding of an exact zero
        "same_top": logq.argmax(-1) == base.topk_idx[:, 0].long(),
        "delta_p": (q_target.double().exp() - base.target_logp.double().exp()).float(),
        "nll_model": -q_target,
        "nll_base": -base.target_logp,
        "tail_mass": base.rest,
    }


def token_stats_from_topk(base: BaseTopK, q_idx: torch.Tensor, q_logp: torch.Tensor, q_target: torch.Tensor,
                          chunk: int = 256) -> dict[str, torch.Tensor]:
    """token_stats when the model's side is known only at its own top-k tokens (a serving engine's prompt
    log-probs): q_idx / q_logp [T, k] (rank order), q_target [T] the log-prob of the token that follows. Both
    distributions are coarsened to the tokens in both top-k lists plus one bucket for all others, so the KLD is
    still a lower bound, and equals token_stats' when the lists cover where the mass is."""
    vocab = int(max(base.topk_idx.max(), q_idx.max())) + 1
    q_at_base = torch.empty(base.topk_idx.shape, dtype=torch.float64)
    for r in range(0, q_idx.shape[0], chunk):  # q at the base's top-k tokens (nan: outside the model's top-k)
        dense = torch.full((min(chunk, q_idx.shape[0] - r), vocab), float("nan"), dtype=torch.float64)
        dense.scatter_(1, q_idx[r : r + chunk].long(), q_logp[r : r + chunk].double())
        q_at_base[r : r + chunk] = dense.gather(1, base.topk_idx[r : r + chunk].long())
    both = ~q_at_base.isnan()
    p_logp = base.topk_logp.double()
    p_both = torch.where(both, p_logp.exp(), 0.0)
    q_both = torch.where(both, q_at_base.exp(), 0.0)
    p_rest = base.rest.double() + (p_logp.exp() - p_both).sum(-1)
    q_rest = (1.0 - q_both.sum(-1)).clamp_min(0.0)
    rest_term = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.clamp_min(1e-300).log()),
                            torch.zeros_like(p_rest))
    kld = torch.where(both, p_both * (p_logp - q_at_base.nan_to_num(0.0)), 0.0).sum(-1) + rest_term
    return {
        "kld": kld.clamp_min(0.0).float(),
        "same_top": q_idx[:, 0].long() == base.topk_idx[:, 0].long(),
        "delta_p": (q_target.double().exp() - base.target_logp.double().exp()).float(),
        "nll_model": -q_target.float(),
        "nll_base": -base.target_logp,
        "tail_mass": base.rest,
    }


def _mean_stderr(x: np.ndarray) -> tuple[float, float]:
    n = x.size
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


@dataclass
class ShiftAccumulator:
    """Collects per-token scalars window by window (never logits) and summarises them."""
    parts: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        for key, value in stats.items():
            self.parts.setdefault(key, []).append(value.detach().cpu().numpy())

    def column(self, key: str) -> np.ndarray:
        return np.concatenate(self.parts[key]).astype(np.float64)

    def summary(self) -> dict:
        kld = self.column("kld")
        nll_m, nll_b = self.column("nll_model"), self.column("nll_base")
        dp = self.column("delta_p")
        ln_ratio, ln_ratio_se = _mean_stderr(nll_m - nll_b)
        kld_mean, kld_se = _mean_stderr(kld)
        q = np.quantile(kld, [0.5, 0.9, 0.95, 0.99, 0.999])
        hist, _ = np.histogram(kld, bins=HIST_EDGES)
        return {
            "tokens": int(kld.size),
            "ppl": {"model": math.exp(nll_m.mean()), "base": math.exp(nll_b.mean()),
                    "ln_ratio": {"mean": ln_ratio, "stderr": ln_ratio_se}},
            "kld": {"mean": kld_mean, "stderr": kld_se, "median": float(q[0]), "p90": float(q[1]),
                    "p95": float(q[2]), "p99": float(q[3]), "p999": float(q[4]), "max": float(kld.max()),
                    "histogram": {"edges": HIST_EDGES[1:-1], "counts": hist.tolist()}},
            "same_top": float(self.column("same_top").mean()),
            "delta_p": {"mean": float(dp.mean()), "rms": float(np.sqrt((dp ** 2).mean()))},
            "tail_mass_mean": float(self.column("tail_mass").mean()),
            # each window's mean: two artifacts scored on the same windows compare pairwise (benchmarks/paired.py), with
            # an error bar from the windows' spread instead of each artifact's own, far wider, per-token one
            "per_window": {k: [float(p.astype(np.float64).mean()) for p in self.parts[k]]
                           for k in ("nll_model", "kld")},
        }
