#!/usr/bin/env python
"""FP8 KV cache on SmolLM2-135M: perplexity per bundled domain of RTN W4A16 with and without an FP8 (e4m3) KV cache.

One `quantkit quantize` of recipes/smollm2-135m-gptq-w4a16-kv8.yaml with its weight stage swapped for RTN W4A16
(data-free: the same weights as recipes/smollm2-135m-rtn-w4a16.yaml) and `kv_cache: {strategy: head}`; its
artifact is then evaluated in quantkit's runtime with its KV cache hooks
  - off: the W4A16 artifact itself (RTN weights do not depend on the calibration);
  - per head: the artifact as written (strategy head);
  - per tensor: max over the heads of the same amax (bit for bit what strategy tensor writes);
  - per token: an oracle, amax / 448 of every token's own key / value in each head (no static scale does better),
    which shows what is left when the scale is perfect: e4m3's 3-bit mantissa;
  - with --headroom H: per tensor and per head with H times the scale (amax·H / 448): states up to H times the
    calibration's amax pass unclamped, at the cost of the smallest values falling below e4m3's normal range sooner.

    python benchmarks/kv_cache.py --out /tmp/kv --num-samples 32 --windows 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ("wikitext2", "fiction", "code", "chat", "math")


def per_token(key: torch.Tensor, value: torch.Tensor):
    from quantkit.kernels.kv_cache import qdq, scale_of

    return tuple(qdq(x, scale_of(x.abs().amax(dim=-1, keepdim=True).float())) for x in (key, value))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows (the recipe's 128 tokens)")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows of 512 tokens per domain")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--headroom", type=float, help="also per tensor / per head with this many times the scale")
    p.add_argument("--skip", default="", help="variants not to run, comma-separated (their rows are left out)")
    a = p.parse_args()
    from quantkit.evaluation.perplexity import eval_tokens, perplexity
    from quantkit.kernels.kv_cache import apply_fp8_kv, attention_modules, on_states
    from quantkit.progress import Reporter
    from quantkit.runtime import load, read_tensors

    a.out.mkdir(parents=True, exist_ok=True)
    r = yaml.safe_load((REPO / "recipes" / "smollm2-135m-gptq-w4a16-kv8.yaml").read_text())
    r.pop("release", None), r.pop("gates", None)
    r["stages"] = [{"rtn": {"bits": 4, "group_size": 64, "sym": True, "ignore": ["lm_head"]}}]
    r["calibration"]["num_samples"] = a.num_samples
    r["kv_cache"] = {"bits": 8, "type": "float", "strategy": "head"}
    r["export"] = {"output": str(a.out / "rtn-kv8"), "formats": ["compressed-tensors"]}
    recipe = a.out / "rtn-kv8.yaml"
    recipe.write_text(yaml.safe_dump(r, sort_keys=False))
    artifact = a.out / "rtn-kv8" / "compressed-tensors"
    t0 = time.perf_counter()
    if not artifact.is_dir():
        subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe)], check=True)
    quantize_s = time.perf_counter() - t0
    loaded = load(str(artifact))
    model, tok = loaded.model, loaded.tokenizer
    head = {k: t for k, t in read_tensors(artifact).items() if k.endswith(("k_scale", "v_scale"))}
    tensor = {k: t.amax().reshape(1) for k, t in head.items()}
    modules = attention_modules(model)

    def hooks(variant: str) -> list:
        for m in modules.values():
            m._forward_pre_hooks.clear()
        if variant == "per head":
            return apply_fp8_kv(model, head)
        if variant == "per tensor":
            return apply_fp8_kv(model, tensor)
        if variant.startswith("per tensor ×") or variant.startswith("per head ×"):
            scales = tensor if variant.startswith("per tensor") else head
            return apply_fp8_kv(model, {k: s * a.headroom for k, s in scales.items()})
        if variant == "per token (oracle)":
            return [on_states(m, per_token) for m in modules.values()]
        return []

    variants = ["W4A16 (16-bit KV)", "per tensor", "per head", "per token (oracle)"]
    if a.headroom:
        variants += [f"per tensor ×{a.headroom:g}", f"per head ×{a.headroom:g}"]
    variants = [v for v in variants if v not in a.skip.split(",")]
    rows: dict[str, dict[str, float]] = {v: {} for v in variants}
    report = Reporter(quiet=True)
    for domain in DOMAINS:
        ids = eval_tokens(tok, domain, a.windows * a.seq_len)
        for v in variants:
            hooks(v)
            rows[v][domain] = perplexity(model, ids, a.seq_len, report)["ppl"]
            print(f"{domain:10s} {v:22s} {rows[v][domain]:.4f}", flush=True)
    base = rows[variants[0]]
    lines = ["| KV cache | " + " | ".join(DOMAINS) + " |", "|---|" + "---|" * len(DOMAINS)]
    for v in variants:
        cells = [f"{rows[v][d]:.3f}" + ("" if v == variants[0] else f" ({100 * (rows[v][d] / base[d] - 1):+.2f} %)")
                 for d in DOMAINS]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    (a.out / "kv_cache.json").write_text(json.dumps({"ppl": rows, "quantize_s": round(quantize_s, 1),
                                                     "num_samples": a.num_samples, "windows": a.windows,
                                                     "seq_len": a.seq_len}, indent=2))
    (a.out / "kv_cache.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
