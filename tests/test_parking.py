"""Parking: while a wide Linear's Hessian is summed and solved, every micro-batch's copy of its input and the block's
quantized weights wait on disk, and each solver's H⁻¹ goes as soon as no Linear can read its input again. The
artifact keeps its bytes; what is resident at the solve is the Hessian, the Linear's weight and little else."""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli, write_recipe
from test_resume import safetensors_bytes
from test_streaming import STAGES, sharded_checkpoint

from quantkit.algorithms import gptq
from quantkit.algorithms.gptq import Hessian
from quantkit.quantize import gptq as qgptq
from quantkit.quantize import microbatches, parking
from quantkit.quantize.parking import Parked


def test_a_parked_tensor_is_emptied_read_back_in_pieces_and_restored_bit_exact():
    t = torch.randn(5, 7, 9).to(torch.bfloat16)
    want = t.clone()
    shared = torch.randn(6, 4)
    view = shared[2:]  # a micro-batch of a larger tensor: its storage is not its own
    p = Parked()
    p.park(t)
    p.park(view)
    assert t.untyped_storage().nbytes() == 0 and p.holds(t)
    assert not p.holds(view) and shared.untyped_storage().nbytes() == 6 * 4 * 4
    pieces = list(p.pieces(t, 2))
    assert [tuple(x.shape) for x in pieces] == [(2, 7, 9), (2, 7, 9), (1, 7, 9)]
    assert torch.equal(torch.cat(pieces), want)
    assert list(p.pieces(view, 1)) == [view]  # not parked: itself
    codes = torch.randint(0, 16, (6, 8), dtype=torch.uint8).T  # GPTQ's codes: a transpose, all of its storage
    codes_want = codes.clone()
    p.park(codes)
    assert codes.untyped_storage().nbytes() == 0 and p.holds(codes)
    assert torch.equal(torch.cat(list(p.pieces(codes, 3))), codes_want)  # not in row order on disk: read whole
    p.restore()
    assert torch.equal(t, want) and not p.holds(t) and torch.equal(codes, codes_want)
    t.add_(1)  # its storage is an ordinary one again
    assert torch.equal(t, want + 1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return sharded_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", tied=False, layers=3)


def quantize(monkeypatch, tmp_path: Path, name: str, model: Path, min_hessian: int) -> dict:
    """GPTQ of 8 windows in micro-batches of 3, parking the inputs of Linears whose Hessian has min_hessian bytes."""
    monkeypatch.setattr(microbatches, "TOKENS", 3 * 64)
    monkeypatch.setattr(parking, "MIN_HESSIAN", min_hessian)
    recipe = write_recipe(tmp_path / f"{name}.yaml", model, tmp_path / name, STAGES["gptq"], ("compressed-tensors",),
                          load="stream")
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet", "--json", tmp_path / f"{name}.json") == 0
    return {"bytes": safetensors_bytes(tmp_path / name / "compressed-tensors"),
            "summary": json.loads((tmp_path / f"{name}.json").read_text())}


def test_at_a_wide_linears_solve_its_inputs_and_the_blocks_quantized_weights_are_parked(llama, tmp_path,
                                                                                         monkeypatch):
    """down_proj (128 wide; the tiny model's only wide input here): when its solve starts, every micro-batch's
    input to it and the block's input are on disk, the only 2-D weight in memory is down_proj's own, no other
    Linear's codes are in memory and no other solver's H⁻¹ is alive, in the first block too (its groups are learned
    before its forward). The bytes are those of a run that parks nothing."""
    config = json.loads((llama / "config.json").read_text())
    inter, hidden = config["intermediate_size"], config["hidden_size"]
    seen = []
    solver = qgptq._solver

    def checked(h, *args):
        if h.columns == inter:
            gc.collect()  # only what is reachable
            live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
            inputs = [t for t in live if t.dim() == 3 and t.shape[-1] == inter]
            weights = [t for t in live if isinstance(t, torch.nn.Parameter) and t.dim() == 2
                       and t.untyped_storage().nbytes() > 0]
            solvers = [o for o in gc.get_objects() if isinstance(o, gptq.GPTQ)]
            codes = [t for t in live if t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] >= hidden  # not zeros
                     and t.untyped_storage().nbytes() > 0]
            block_input = [t for t in live if tuple(t.shape) == (8, 64, hidden) and t.untyped_storage().nbytes() > 0]
            seen.append((len(inputs), sum(t.untyped_storage().nbytes() for t in inputs),
                         [tuple(w.shape) for w in weights], len(solvers),
                         len({t.untyped_storage().data_ptr() for t in codes}), len(block_input)))
        return solver(h, *args)

    monkeypatch.setattr(qgptq, "_solver", checked)
    folders = []
    temp = tempfile.TemporaryFile
    monkeypatch.setattr(parking, "tempfile", SimpleNamespace(TemporaryFile=lambda dir: (folders.append(dir),
                                                                                     temp(dir=dir))[1]))
    parked = quantize(monkeypatch, tmp_path, "parked", llama, Hessian.nbytes(inter))
    # in the output's spill folder (the plan counts the bytes there), removed at the end
    spill = tmp_path / "parked" / ".quantkit-activations"
    assert folders and set(folders) == {spill} and not spill.exists()
    assert parked["summary"]["memory"]["plan"]["disk"]["parked"] > 0
    # 3 micro-batches' inputs, all empty, none of the 6 quantized Linears' codes and not the block's input (8
    # windows of 64 tokens), in each of 3 blocks
    assert seen == [(3, 0, [(hidden, inter)], 0, 0, 0)] * 3
    seen.clear()
    kept = quantize(monkeypatch, tmp_path, "kept", llama, 1 << 62)
    # without parking: the inputs, the whole block and its codes are resident
    assert seen[0][1] > 0 and len(seen[0][2]) == 7 and seen[0][4] == 6 and seen[0][5] >= 1
    assert parked["bytes"] == kept["bytes"]
    assert parked["summary"]["loss_total"] == kept["summary"]["loss_total"]


def test_every_block_solves_each_group_of_linears_in_one_pass(llama, tmp_path, monkeypatch):
    """q/k/v and gate/up read one tensor each: one factorization and one pass over the rows per input, in block 0
    as well (before, block 0 learned the groups by solving q, k, v, gate and up one by one)."""
    passes = []
    many = gptq.GPTQ.quantize_many

    def counted(self, ws, **kw):
        passes.append(len(ws))
        return many(self, ws, **kw)

    monkeypatch.setattr(gptq.GPTQ, "quantize_many", counted)
    quantize(monkeypatch, tmp_path, "groups", llama, 1 << 62)
    assert passes == [3, 1, 2, 1] * 3
