"""Token perplexity, GPTQ-style: tokenize the whole evaluation text once (the tokenizer's own special
tokens, so at most one BOS at the very start), cut it into non-overlapping windows of seq_len tokens
(the tail shorter than a window is dropped), and average the next-token NLL over every predicted token
of every window (seq_len-1 per window, no context carried across windows)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .. import data
from ..errors import QuantkitError
from ..progress import Reporter


def eval_tokens(tokenizer, dataset: str, max_tokens: int | None = None) -> torch.Tensor:
    """A text domain's evaluation split (conversations in the tokenizer's chat template when it has one)."""
    path = data.resolve(dataset, "eval", f"--dataset {dataset}")
    text = data.read_text(path, field=f"--dataset {dataset}", render_chat=data.chat_renderer(tokenizer, None))
    ids = data.token_ids(tokenizer, text)
    return ids[:max_tokens] if max_tokens else ids


def num_windows(ids: torch.Tensor, seq_len: int) -> int:
    windows = ids.numel() // seq_len
    if windows == 0:
        raise QuantkitError(f"--seq-len: {seq_len} is longer than the {ids.numel()} evaluation tokens")
    return windows


@torch.no_grad()
def window_logits(model, ids: torch.Tensor, seq_len: int, report: Reporter, label: str,
                  device: str | torch.device = "cpu") -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yields (window index, logits [seq_len-1, V] on CPU-or-device, next-token targets [seq_len-1])."""
    for i in report.steps(label, num_windows(ids, seq_len)):
        window = ids[i * seq_len : (i + 1) * seq_len].unsqueeze(0).to(device)
        yield i, model(input_ids=window, use_cache=False).logits[0, :-1], window[0, 1:]


def perplexity(model, ids: torch.Tensor, seq_len: int, report: Reporter, device: str | torch.device = "cpu") -> dict:
    start = time.perf_counter()
    nll, count = 0.0, 0
    for _, logits, targets in window_logits(model, ids, seq_len, report, "ppl window", device):
        nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        count += targets.numel()
    return {
        "ppl": math.exp(nll / count),
        "nll": nll / count,
        "windows": num_windows(ids, seq_len),
        "seq_len": seq_len,
        "tokens_scored": count,
        "seconds": round(time.perf_counter() - start, 2),
    }
