"""Host tensors put aside on disk while a wide Linear's GPTQ solve holds the memory.

At a GPTQ barrier (microbatches.py) every micro-batch holds the Linear's input until the Linear is solved. For a
wide input (a large model's down_proj) that is the C x C Hessian and every window's input at once: 0.25 GiB and
0.13 GiB at C = 8192 and 16 x 512 tokens, and the input grows with the calibration set. Each micro-batch parks its
input here as it reaches the barrier, the Hessian reads the inputs back a window at a time, and they are restored
just before the Linear runs; the block's already quantized weights and codes wait here too. The tensor object stays
where the suspended forward holds it: only its storage is emptied (`resize_(0)`, as FSDP frees a parameter's
storage between uses) and refilled in place, so the forward resumes on the same bytes.
"""

from __future__ import annotations

import ctypes
import math
import tempfile
from pathlib import Path

import torch

from ..algorithms.gptq import Hessian

MIN_HESSIAN = 64 << 20  # park inputs of Linears whose Hessian is at least this (C >= ~4096): below it, the disk
# traffic (every window's input, written and read back) costs more time than the memory it frees is worth


def worth_it(columns: int, device: torch.device) -> bool:
    """Parking is for host memory: on a GPU the device holds the inputs, and the plan counts them there."""
    return device.type == "cpu" and Hessian.nbytes(columns) >= MIN_HESSIAN


class Parked:
    """Tensors whose storages are on disk until `restore`, in unlinked files under `folder` (the output's spill
    folder, where the plan counted the bytes: the system temp folder may be a RAM disk)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder
        self._items: list[tuple[torch.Tensor, torch.UntypedStorage, int, object]] = []

    def park(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        # only a tensor that is all of its storage: a view (a micro-batch of the block's input) shares it with others
        if not storage.resizable() or storage.nbytes() != t.nbytes or t.numel() == 0:
            return
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        f = tempfile.TemporaryFile(dir=self.folder)  # unlinked at once: gone with the process, whatever ends it
        f.write(_bytes(storage))
        self._items.append((t, storage, storage.nbytes(), f))
        storage.resize_(0)

    def _item(self, t: torch.Tensor) -> tuple | None:
        return next((i for i in self._items if i[0] is t), None)

    def holds(self, t: torch.Tensor) -> bool:
        return self._item(t) is not None

    def pieces(self, t: torch.Tensor, rows: int):
        """t's values, `rows` along its first dimension at a time: t itself if it is not parked, else read from the
        file a piece at a time (t spans its storage, so its bytes are the file's in order when t is contiguous)."""
        item = self._item(t)
        if item is None:
            yield t
            return
        f, step = item[3], rows * math.prod(t.shape[1:]) * t.element_size()
        f.seek(0)
        if not t.is_contiguous():  # its bytes are not in row order: read whole
            whole = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            if f.readinto(_bytes(whole.untyped_storage())) != t.nbytes:
                raise OSError(f"parked activations: short read from {f.name}")
            yield from whole.split(rows)
            return
        for r0 in range(0, t.shape[0], rows):
            piece = torch.empty((min(rows, t.shape[0] - r0), *t.shape[1:]), dtype=t.dtype)
            if f.readinto(_bytes(piece.untyped_storage())) != min(step, piece.nbytes):
                raise OSError(f"parked activations: short read from {f.name}")
            yield piece

    def restore(self) -> None:
        for _, storage, nbytes, f in self._items:
            storage.resize_(nbytes)
            f.seek(0)
            if f.readinto(_bytes(storage)) != nbytes:
                raise OSError(f"parked activations: short read from {f.name}")
            f.close()
        self._items.clear()


def _bytes(storage: torch.UntypedStorage) -> memoryview:
    """The storage's bytes, in place (Tensor.numpy() would mark the storage as never to be resized again)."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")
