"""Per-block checkpoints of a layer-wise run, so a killed quantization resumes instead of starting over.

After block i the run saves, under EXPORT_OUTPUT/.quantkit-resume/KEY/:
  block-i.safetensors   the block's float state as the next blocks see it (scales folded, weights replaced by
                        their dequantized values) and its quantized weights (codes, scales, zeros / FP8)
  hidden-i.safetensors  the hidden states entering block i+1, a key per batch (hidden.HiddenStates.save;
                        offloaded to disk: a file per batch)
  state.json            {"done": i, losses, pass counters}: written last, by rename, so it never names a block
                        whose files are incomplete
The files are written by a background thread while the next block runs (the GIL is released while they are
written), and state.json names block i once they are complete: at the next save, or at flush() after the last block.
KEY hashes everything the result depends on (recipe stages and calibration, the model's files, the calibration
tokens, package versions), so a changed recipe or model never resumes from a stale run. Restoring block states and
hidden states bit for bit makes the resumed run's artifact byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..algorithms.scheme import QuantizedTensor
from ..errors import QuantkitError
from ..files import write_json_atomic
from .hidden import HiddenStates
from .distributed import Ranks

FOLDER = ".quantkit-resume"


def run_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def _pack_weights(qweights: dict[str, QuantizedTensor]) -> tuple[dict, dict]:
    """The block file's `q.<module>.<tensor>` entries and state.json's `specs` (each module's meta)."""
    tensors = {f"q.{name}.{k}": t for name, qw in qweights.items() for k, t in qw.to_tensors().items()}
    return tensors, {name: qw.meta() for name, qw in qweights.items()}


def _unpack_weights(tensors: dict[str, torch.Tensor], specs: dict) -> dict[str, QuantizedTensor]:
    out = {}
    for name, meta in specs.items():
        prefix = f"q.{name}."
        out[name] = QuantizedTensor.from_tensors(
            {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}, meta)
    return out


class BlockCheckpoints:
    """Under several processes every rank keeps its own share of hidden states (hidden-i-rankR); rank 0 writes the
    block files and state.json, which names block i only once every rank's hidden-i is on disk."""

    def __init__(self, output: str | Path, key: str, ranks: Ranks = Ranks()):
        self.root = Path(output) / FOLDER
        self.folder = self.root / key
        self.ranks = ranks
        self._pending: tuple[threading.Thread, int, dict] | None = None  # the save being written
        self._error: BaseException | None = None

    def _hidden(self, i: int) -> Path:
        suffix = f"-rank{self.ranks.rank}" if self.ranks.active else ""
        return self.folder / f"hidden-{i}{suffix}.safetensors"

    @property
    def state(self) -> dict:
        path = self.folder / "state.json"
        return json.loads(path.read_text()) if path.is_file() else {"done": -1}

    def save(self, i: int, block: nn.Module, qweights: dict, losses: dict, hidden: HiddenStates, extra: dict) -> None:
        """Block i is complete: qweights / losses are the block's own entries, hidden what enters block i+1. Its
        files are written in the background; the previous save's are waited for first."""
        self.flush()
        self.folder.mkdir(parents=True, exist_ok=True)
        writes = [hidden.save(self._hidden(i))]
        q, specs = _pack_weights(qweights)
        if self.ranks.rank == 0:
            tensors = {f"block.{k}": v for k, v in block.state_dict().items()} | q
            writes.append(lambda: _save(tensors, self.folder / f"block-{i}.safetensors"))

        def write() -> None:
            try:
                for w in writes:
                    w()
            except BaseException as err:  # raised in the main thread by flush()
                self._error = err

        thread = threading.Thread(target=write, name=f"checkpoint-{i}", daemon=True)
        thread.start()
        # a snapshot: the passes keep adding to their counters while block i+1 runs, before flush() writes them
        self._pending = (thread, i, {"losses": losses, "specs": specs, "extra": copy.deepcopy(extra)})

    def flush(self) -> int | None:
        """Waits until the last save's files are on disk (every rank's), then names its block in state.json; returns
        that block's index (None: no save was pending)."""
        if self._pending is None:
            return None
        thread, i, body = self._pending
        self._pending = None
        thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise QuantkitError(f"checkpoint: cannot write block {i}'s files under {self.folder}: {err}") from err
        self.ranks.barrier()
        if self.ranks.rank == 0:
            state = self.state
            body = {"done": i, "losses": state.get("losses", {}) | body["losses"],
                    "specs": state.get("specs", {}) | body["specs"], "extra": body["extra"]}
            write_json_atomic(self.folder / "state.json", body, indent=None)
        self.ranks.barrier()  # state.json names block i: the older hidden states can go
        for old in HiddenStates.saved(self._hidden(i - 1)):  # only the newest one is ever read
            old.unlink(missing_ok=True)
        return i

    def salvage(self) -> None:
        """After an error in a later block: a save whose files are complete still counts, so the rerun resumes after
        it. One process only: under several, the other ranks may never reach flush()'s barriers."""
        if self._pending is None or self.ranks.active:
            return
        try:
            self.flush()
        except QuantkitError:
            pass  # those files are incomplete; the error that ended the run is the one to report

    def restore(self, blocks: nn.ModuleList, put, qweights: dict, hidden: HiddenStates) -> tuple[dict, dict]:
        """Hands blocks 0..done to put(i, block, state, block_qweights) one at a time, after adding the block's
        quantized weights to `qweights`, and loads the hidden states entering block done+1 into `hidden`; returns
        (losses, extra)."""
        state = self.state
        for i in range(state["done"] + 1):
            tensors = load_file(str(self.folder / f"block-{i}.safetensors"))
            block_state = {k.removeprefix("block."): v for k, v in tensors.items() if k.startswith("block.")}
            specs = {n: s for n, s in state["specs"].items() if any(k.startswith(f"q.{n}.") for k in tensors)}
            qweights |= _unpack_weights(tensors, specs)
            put(i, blocks[i], block_state, qweights)
        hidden.load(self._hidden(state["done"]))
        return state["losses"], state.get("extra", {})

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
