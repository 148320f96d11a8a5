"""The original model run block by block from its safetensors checkpoint, for a `--base` that does not fit in
memory (`--base-load stream`).

Every evaluation window goes through block 0, then block 1, ...: each block is read from the shards onto the device,
run on all windows at once and freed, as `quantkit quantize` streams it (quantize/source.py). Then the blocks are
swapped for a replay of the final hidden states, and the model's own forward runs the rest (final norm, head, any
logit soft-capping) window by window, so nothing after the blocks is re-implemented here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..model import decoder_blocks, resolve_model_path
from ..progress import Reporter
from ..quantize.capture import capture_block_inputs, to_device
from ..quantize.source import Streamed
from .perplexity import num_windows


class _Replay(nn.Module):
    """Stands in for block 0: returns window `index`'s final hidden state, whatever it is given."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden, self.index = hidden, 0

    def forward(self, hidden_states, *args, **kwargs):
        return self.hidden[self.index : self.index + 1].to(hidden_states.dtype)


class _Pass(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def open_base(spec: str, dtype: str) -> Streamed:
    folder, _ = resolve_model_path(spec, "--base")
    return Streamed(folder, dtype)


@torch.no_grad()
def streamed_window_logits(base: Streamed, ids: torch.Tensor, seq_len: int, report: Reporter,
                           device: torch.device) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yields (window index, logits [seq_len-1, V], next-token targets), as perplexity.window_logits does."""
    model, blocks = base.model, decoder_blocks(base.model)[1]
    windows = ids[: num_windows(ids, seq_len) * seq_len].view(-1, seq_len)
    with base.capture():
        hidden, calls = capture_block_inputs(model, blocks, windows)
    hidden = hidden.to(device)
    for i in report.steps("base block", len(blocks)):
        base.load(i, blocks[i], device)
        args, kwargs = to_device(calls[i], device)
        out = blocks[i](hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        base.done(i, blocks[i], {})
    replay = _Replay(hidden.cpu())
    real = list(blocks)
    for j in range(len(blocks)):
        blocks[j] = replay if j == 0 else _Pass()
    try:
        with base.capture():  # the final norm and the head, on first call
            for w in report.steps("base window", windows.shape[0]):
                replay.index = w
                logits = model(input_ids=windows[w : w + 1], use_cache=False).logits[0, :-1]
                yield w, logits.to(device), windows[w, 1:].to(device)
    finally:
        for j, block in enumerate(real):
            blocks[j] = block
