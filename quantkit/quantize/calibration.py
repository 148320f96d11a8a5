"""Calibration samples: random fixed-length token windows from one text, as the GPTQ reference does."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .. import data
from ..errors import QuantkitError
from ..recipe import Calibration


@dataclass
class CalibrationSet:
    tokens: torch.Tensor  # int64 [num_samples, seq_len]
    source: str
    sha256: str  # of the token ids, so a manifest pins exactly what the model saw


def build(tokenizer, cfg: Calibration) -> CalibrationSet:
    path = data.resolve(cfg.dataset, "calibration", "calibration.dataset")
    text = data.read_text(path, cfg.text_field, "calibration.dataset")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    # windows may overlap, but a text shorter than num_samples x seq_len would mostly repeat itself
    need = cfg.num_samples * cfg.seq_len
    if ids.numel() < need:
        raise QuantkitError(
            f"calibration.dataset: {path} has {ids.numel()} tokens, need at least {need} (num_samples "
            f"{cfg.num_samples} x seq_len {cfg.seq_len}); use a longer text or lower num_samples / seq_len"
        )
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, ids.numel() - cfg.seq_len + 1, (cfg.num_samples,), generator=gen)
    tokens = torch.stack([ids[s : s + cfg.seq_len] for s in starts.tolist()])
    digest = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
    return CalibrationSet(tokens, str(path), digest)
