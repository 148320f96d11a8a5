"""Distribution shift of a model against its original over the same token windows: the original's
top-k log-probs come from the on-disk cache (filled by one pass of the original when missing), the
model is run once, window by window."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import cache
from ..errors import QuantkitError
from ..model import model_fingerprint
from ..progress import Reporter
from .distribution import BaseTopK, ShiftAccumulator, token_stats
from .perplexity import num_windows, window_logits


class LogitCache:
    def __init__(self, root: Path, entry_key: str):
        self.folder = root / "base-logits" / entry_key
        self._writer: cache.EntryWriter | None = None

    def complete(self) -> bool:
        return (self.folder / cache.META).is_file()

    def meta(self) -> dict:
        return json.loads((self.folder / cache.META).read_text())

    def read(self, window: int) -> BaseTopK:
        t = load_file(str(self.folder / f"w{window:06d}.safetensors"))
        return BaseTopK(t["topk_logp"], t["topk_idx"], t["rest"], t["target_logp"])

    def start(self) -> None:
        self._writer = cache.EntryWriter(self.folder)

    def write(self, window: int, base: BaseTopK) -> None:
        save_file({"topk_logp": base.topk_logp, "topk_idx": base.topk_idx, "rest": base.rest,
                   "target_logp": base.target_logp},
                  str(self._writer.tmp / f"w{window:06d}.safetensors"))

    def commit(self, meta: dict) -> None:
        self._writer.commit(meta)
        self._writer = None

    def abort(self) -> None:
        if self._writer:
            self._writer.abort()
            self._writer = None


def base_logits_entry(base: str, ids: torch.Tensor, seq_len: int, top_k: int, dtype: str,
                      device: torch.device, root) -> tuple[LogitCache, dict]:
    used = ids[: num_windows(ids, seq_len) * seq_len]
    parts = {
        "base": model_fingerprint(base), "tokens": cache.tokens_sha256(used), "seq_len": seq_len,
        "top_k": top_k, "dtype": dtype, "device": device.type,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }
    return LogitCache(root, cache.key(**parts)), parts


def fill_base_cache(entry: LogitCache, parts: dict, base: str, tokens_of: Callable | None, ids: torch.Tensor,
                    top_k: int, tokenizer, logits: Iterator, extra_meta: dict | None = None) -> None:
    """logits: the base's (window, logits, targets), from a whole model (perplexity.window_logits) or streamed
    block by block (streamed.streamed_window_logits). tokens_of(base tokenizer): the text's ids, which must be the
    model's `ids` (None: ids are the base's own, as for the self domain)."""
    if tokens_of is not None and not torch.equal(tokens_of(tokenizer), ids):
        raise QuantkitError(f"--base: {base} tokenizes the evaluation text differently from the model "
                            "(a different tokenizer cannot be compared token by token)")
    entry.start()
    try:
        for i, window_logits_, targets in logits:
            entry.write(i, BaseTopK.from_logits(window_logits_, targets, top_k).to("cpu"))
        entry.commit({"key_parts": parts, **(extra_meta or {})})
    except BaseException:
        entry.abort()
        raise


def distribution_shift(model, entry: LogitCache, ids: torch.Tensor, seq_len: int, top_k: int,
                       device: torch.device, report: Reporter) -> dict:
    start = time.perf_counter()
    acc = ShiftAccumulator()
    for i, logits, targets in window_logits(model, ids, seq_len, report, "model window", device):
        acc.add(token_stats(entry.read(i).to(logits.device), logits, targets))
    return acc.summary() | {"windows": num_windows(ids, seq_len), "top_k": top_k,
                            "base_cache": str(entry.folder), "seconds": round(time.perf_counter() - start, 2)}
