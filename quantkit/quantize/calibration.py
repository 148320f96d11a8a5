"""Calibration samples: random fixed-length token windows, as the GPTQ reference draws them, from one source or a
weighted mixture of sources (each part gets its share of the windows, drawn from its own text)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .. import data
from ..errors import QuantkitError
from ..progress import Reporter
from ..recipe import Calibration, CalibrationPart

FIELD = "calibration.dataset"


@dataclass
class CalibrationSet:
    tokens: torch.Tensor  # int64 [num_samples, seq_len]
    source: str
    sha256: str  # of the token ids, so a manifest pins exactly what the model saw
    parts: list[dict]  # per source: dataset, weight, windows


def parts_of(cfg: Calibration) -> list[CalibrationPart]:
    if isinstance(cfg.dataset, list):
        return cfg.dataset
    if cfg.dataset == "mixture":
        return [CalibrationPart(dataset=d, weight=w) for d, w in data.MIXTURE.items()]
    return [CalibrationPart(dataset=cfg.dataset, weight=1.0, text_field=cfg.text_field)]


def shares(weights: list[float], total: int) -> list[int]:
    """total split by weight, largest remainder (ties to the earlier part): deterministic and sums to total."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


def build(tokenizer, cfg: Calibration, model_spec: str | None = None, dtype: str = "auto",
          device: torch.device | None = None, report: Reporter | None = None) -> CalibrationSet:
    """model_spec, dtype, device: the original model, for `self` parts (generated, or read from the cache)."""
    parts = parts_of(cfg)
    counts = shares([p.weight for p in parts], cfg.num_samples)
    render = data.chat_renderer(tokenizer, cfg.chat_template)
    rows, described = [], []
    for index, (part, count) in enumerate(zip(parts, counts)):
        if count == 0:
            raise QuantkitError(f"{FIELD}: part '{part.dataset}' gets no window of {cfg.num_samples} "
                                "(raise its weight or num_samples)")
        where = FIELD if len(parts) == 1 else f"{FIELD}[{index}]"
        if part.dataset == data.SELF:
            from .. import self_text

            ids = self_text.tokens(model_spec, count * cfg.seq_len, "calibration", dtype, device or torch.device("cpu"),
                                   report or Reporter(quiet=True), seed=cfg.seed)
            rows.append(ids.view(count, cfg.seq_len))  # the stream is already random text: consecutive windows
            source = "self"
        else:
            path = data.resolve(part.dataset, "calibration", where)
            text = data.read_text(path, part.text_field, where, render)
            ids = data.token_ids(tokenizer, text, add_special_tokens=False)
            # windows may overlap, but a text shorter than its windows would mostly repeat itself
            need = count * cfg.seq_len
            if ids.numel() < need:
                raise QuantkitError(
                    f"{where}: {path} has {ids.numel()} tokens, need at least {need} "
                    f"({'num_samples' if len(parts) == 1 else 'its windows'} {count} x seq_len {cfg.seq_len}); "
                    "use a longer text or lower num_samples / seq_len")
            gen = torch.Generator().manual_seed(cfg.seed + 7919 * index)  # part 0 draws what a single source did
            starts = torch.randint(0, ids.numel() - cfg.seq_len + 1, (count,), generator=gen)
            rows.append(torch.stack([ids[s : s + cfg.seq_len] for s in starts.tolist()]))
            source = str(path)
        described.append({"dataset": part.dataset, "weight": part.weight, "windows": count, "source": source})
    tokens = torch.cat(rows)
    digest = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
    source = described[0]["source"] if len(parts) == 1 else "mixture of " + ", ".join(
        f"{d['dataset']} x{d['windows']}" for d in described)
    return CalibrationSet(tokens, source, digest, described)
