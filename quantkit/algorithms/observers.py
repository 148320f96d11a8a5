"""Observers of a Linear's input over the calibration windows: the static FP8 input scale (the FP8 preset), and
NVFP4's input global scale (its inputs' e4m3 group scales are made over it at run time).

Each observer keeps statistics that ranks combine exactly, so N processes give the bytes of one: the largest |x|
(reduced by max) and a histogram of |x| on fixed log-spaced bins (reduced by sum; float64 counts are exact).
The scale is then chosen from them:
  minmax      max|x| / 448: nothing clips (llm-compressor's static_minmax)
  mse         the clip c = max|x|·(1 - i/100), i < 20, of least squared FP8 error over the histogram, each bin at
              its geometric centre (llm-compressor's mse observer searches the same shrink grid, per batch)
  percentile  the 99.99th percentile of |x| (the upper edge of its bin, at most max|x|)
NVFP4's global scale is compressed-tensors' generate_gparam of the clip: 448 · 6 / clip (minmax: llm-compressor's
static_minmax observer; mse is refused for it, its error model being FP8's).
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization.utils.helpers import generate_gparam

from .fp8 import FP8_DTYPE, FP8_MAX

BINS_PER_OCTAVE = 16
LOW, HIGH = -40, 24  # log2 range of the bins; |x| below 2^-40 counts in the first, above 2^24 in the last
PERCENTILE = 0.9999
SHRINK_STEPS, SHRINK_GRID = 20, 100  # mse: clips 1, 0.99, ..., 0.81 of max|x|


class InputObserver:
    def __init__(self, kind: str):
        self.kind = kind  # minmax | mse | percentile
        self.amax = torch.zeros(1, dtype=torch.float32)
        bins = (HIGH - LOW) * BINS_PER_OCTAVE
        self.hist = torch.zeros(bins, dtype=torch.float64) if kind != "minmax" else None

    def update(self, x: torch.Tensor) -> None:
        a = x.detach().abs().float()
        self.amax = torch.maximum(self.amax, a.amax().cpu().reshape(1))
        if self.hist is not None:
            idx = ((a.clamp_min(2.0 ** LOW).log2() - LOW) * BINS_PER_OCTAVE).long().clamp_(0, self.hist.numel() - 1)
            self.hist += torch.bincount(idx.flatten(), minlength=self.hist.numel()).cpu().double()

    def reduce(self, ranks) -> None:
        """Every rank's statistics combined (quantize/distributed.Ranks), before scale()."""
        ranks.all_reduce(self.amax, "max")
        if self.hist is not None:
            ranks.all_reduce(self.hist, "sum")

    def scale(self, kind: str = "fp8") -> torch.Tensor:
        """float32 [1]: the static input scale of an input kind: fp8's clip / 448 (an input never seen: the scale
        dtype's eps, as compressed-tensors replaces a zero scale), fp4's (NVFP4's) global scale."""
        assert kind in ("fp8", "fp4"), kind
        amax = float(self.amax)
        clip = amax if self.kind == "minmax" else (self._mse(amax) if self.kind == "mse" else self._percentile(amax))
        if kind == "fp4":
            return generate_gparam(torch.tensor([-clip]), torch.tensor([clip]))
        scale = torch.tensor([clip], dtype=torch.float32) / FP8_MAX
        return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)

    def _centres(self) -> torch.Tensor:
        i = torch.arange(self.hist.numel(), dtype=torch.float64)
        return torch.exp2((i + 0.5) / BINS_PER_OCTAVE + LOW)

    def _percentile(self, amax: float) -> float:
        cum = self.hist.cumsum(0)
        if cum[-1] == 0:
            return amax
        i = int(torch.searchsorted(cum, PERCENTILE * cum[-1]))
        return min(amax, 2.0 ** ((i + 1) / BINS_PER_OCTAVE + LOW))

    def _mse(self, amax: float) -> float:
        v, n = self._centres(), self.hist
        keep = n > 0
        v, n = v[keep], n[keep]
        best, best_err = amax, None
        for i in range(SHRINK_STEPS):
            clip = amax * (1 - i / SHRINK_GRID)
            s = clip / FP8_MAX
            if s == 0:
                break
            q = (v / s).clamp(max=FP8_MAX).float().to(FP8_DTYPE).double() * s
            err = float((n * (q - v).square()).sum())
            if best_err is None or err < best_err:
                best, best_err = clip, err
        return best
