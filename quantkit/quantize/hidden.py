"""Where the calibration hidden states between decoder blocks live (`calibration.offload`), in batches of windows.

  device  on the compute device. With one batch (every window) the block runs once over all of them: the pipeline's
          one forward per block
  cpu     in host memory (pinned on CUDA, so the copies overlap), one batch at a time moved to the device
  disk    in safetensors files in a folder of the output, one batch read and one written at a time

Each block reads batch k of its input and writes batch k of its output; `advance()` makes the outputs the next
block's inputs. With several batches a block cannot solve a Linear at its first call, which sees one batch only:
the pipeline then runs the block over every batch once per group of Linears (gptq.waves).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

OFFLOADS = ("device", "cpu", "disk")
FOLDER = ".quantkit-activations"


@dataclass(frozen=True)
class Offload:
    """The memory plan's choice: where the hidden states live, and how many windows a block forward takes."""

    where: str = "device"
    batch_size: int | None = None  # None: every window in one batch
    folder: Path | None = None  # under the output: where tensors spilled to disk go (disk batches, parking.py)

    def describe(self, windows: int) -> str:
        n = len(batches(windows, self.batch_size or windows))
        return f"activations on {self.where}" + (f", {n} batches of {self.batch_size} windows" if n > 1 else "")


def batches(windows: int, batch_size: int) -> list[slice]:
    return [slice(s, min(s + batch_size, windows)) for s in range(0, windows, batch_size)]


class HiddenStates:
    def __init__(self, where: str, device: torch.device, windows: int, batch_size: int, folder: Path | None = None):
        """windows: this process's calibration windows; folder: where `disk` writes and GPTQ parks its inputs
        (parking.py), removed by close when empty."""
        assert where in OFFLOADS
        self.where, self.device = where, device
        self.rows = batches(windows, batch_size)
        self.spill = None if folder is None else Path(folder)
        self.folder = None
        if where == "disk":
            self.folder = self.spill / f"{os.getpid()}"
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True)
        self._in: list = [None] * len(self.rows)
        self._out: list = [None] * len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def one_batch(self) -> bool:
        return len(self.rows) == 1

    def _file(self, side: str, k: int) -> Path:
        return self.folder / f"{side}-{k}.safetensors"

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "device":
            return x.to(self.device)
        host = x.detach().to("cpu")
        return host.pin_memory() if self.device.type == "cuda" else host

    def write(self, k: int, x: torch.Tensor) -> None:
        """Batch k of the current block's output (or, before block 0, of its input: then call advance())."""
        if self.where == "disk":
            save_file({"hidden": x.detach().contiguous().cpu()}, str(self._file("out", k)))
        else:
            self._out[k] = self._store(x)

    def read(self, k: int) -> torch.Tensor:
        """Batch k of the current block's input, on the compute device."""
        if self.where == "disk":
            return load_file(str(self._file("in", k)))["hidden"].to(self.device)
        return self._in[k].to(self.device, non_blocking=True)

    def advance(self) -> None:
        """The outputs written become the next block's inputs."""
        if self.where == "disk":
            for k in range(len(self.rows)):
                self._file("out", k).replace(self._file("in", k))
        else:
            self._in, self._out = self._out, [None] * len(self.rows)

    def save(self, path: Path) -> Callable[[], None]:
        """The current inputs, for a checkpoint: one file, with a key per batch (disk: one file per batch). Returns
        what is left to write, to run while the next block goes on: the files on disk are copied at once (the next
        block's advance() replaces them), the tensors in memory are not changed by it."""
        tmp = path.with_name(path.name + ".tmp")
        if self.where == "disk":
            for k in range(len(self.rows)):
                shutil.copyfile(self._file("in", k), tmp)
                tmp.replace(path.with_name(f"{path.stem}-b{k}{path.suffix}"))
            return lambda: None
        tensors = {f"hidden.{k}": x.detach().contiguous().cpu() for k, x in enumerate(self._in)}

        def write() -> None:
            save_file(tensors, str(tmp))
            tmp.replace(path)

        return write

    def load(self, path: Path) -> None:
        if self.where == "disk":
            for k in range(len(self.rows)):
                shutil.copyfile(path.with_name(f"{path.stem}-b{k}{path.suffix}"), self._file("in", k))
        else:
            tensors = load_file(str(path))
            self._in = [self._store(tensors[f"hidden.{k}"]) for k in range(len(self.rows))]

    @staticmethod
    def saved(path: Path) -> list[Path]:
        """The files save(path) may have written."""
        return [path, *path.parent.glob(f"{path.stem}-b*{path.suffix}")]

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self.spill is not None:
            try:  # the last process out removes the shared folder (parked files are unlinked when made)
                self.spill.rmdir()
            except OSError:
                pass
