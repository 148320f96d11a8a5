"""Block inputs: the hidden states entering the first decoder block and every block's call arguments (masks, rotary
embeddings), captured by one model forward that stops at the last block; and the finiteness check every block's
output passes. Used by the layer-wise run and by the streamed evaluation (eval/streamed.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import QuantkitError


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class Stop(Exception):
    """Raised in a forward to end it early."""

    pass


class _Recorder(nn.Module):
    """Stands in for a decoder block during one model forward: records what the block would receive."""

    def __init__(self, index: int, last: bool, store: dict):
        super().__init__()
        self.index, self.last, self.store = index, last, store

    def forward(self, hidden_states, *args, **kwargs):
        if self.index == 0:
            self.store["hidden"] = hidden_states
        self.store["calls"][self.index] = (args, kwargs)
        if self.last:
            raise Stop
        return hidden_states


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, tokens: torch.Tensor):
    """Hidden states entering block 0 and each block's call arguments (masks, rotary embeddings...)."""
    store: dict = {"calls": {}}
    real = list(blocks)
    for i in range(len(blocks)):
        blocks[i] = _Recorder(i, i == len(blocks) - 1, store)
    try:
        model(input_ids=tokens, use_cache=False)
    except Stop:
        pass
    finally:
        for i, block in enumerate(real):
            blocks[i] = block
    return store["hidden"], [store["calls"][i] for i in range(len(blocks))]


def check_hidden_finite(hidden: torch.Tensor, where: str) -> None:
    # an inf or NaN anywhere makes the sum non-finite. Sums in fp32 (fp16's range could overflow), a few rows at a
    # time: sum(dtype=float32) of a bf16 / fp16 tensor first makes a float32 copy of all of it
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not all(torch.isfinite(part.sum(dtype=torch.float32)) for part in rows.split(256)):
        raise QuantkitError(
            f"calibration: non-finite activations {where} (fp16 overflow?); use dtype: bfloat16 or float32"
        )
