"""README's support matrix, generated from the tests: runs tests/test_families.py (every family x method on a tiny
random model of that family) with QUANTKIT_MATRIX set, so each passing test writes what it checked, and renders
those rows between the support-matrix markers in README.md.

    python benchmarks/support_matrix.py            # ~7 min on 2 cores
    python benchmarks/support_matrix.py --rows F   # render from an earlier run's rows (JSON lines) without testing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
METHODS = ["rtn", "gptq", "awq", "awq+gptq", "smoothquant+gptq w8a8", "fp8"]
HEAD = ["RTN W4", "GPTQ W4", "AWQ W4", "AWQ+GPTQ W4", "SmoothQuant+GPTQ W8A8 int8", "FP8 W8A8"]
SHORT = {"compressed-tensors": "CT", "gptq": "gptq", "awq": "awq"}
FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma 2",
          "gemma3_text": "Gemma 3", "phi3": "Phi-3", "granite": "Granite", "olmo2": "OLMo 2", "opt": "OPT",
          "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE",
          "deepseek_v3": "DeepSeek-V3"}


def run_tests(rows: Path) -> int:
    env = dict(os.environ, QUANTKIT_MATRIX=str(rows))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_families.py")], env=env, cwd=ROOT)


def cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row.get("unsupported"):
        return f"no: {row['unsupported']}"
    q = ", ".join(SHORT[f] for f in row["runtime"])
    t = ", ".join(SHORT[f] for f in row["transformers"]) or "–"
    text = f"{q} · tf {t}"
    if "rtn_error" in row:
        text += f" · {row['error'] / row['rtn_error']:.2f}× RTN"
    return text


def render(rows: list[dict]) -> str:
    by = {(r["family"], r["method"]): r for r in rows}
    lines = ["| family | " + " | ".join(HEAD) + " |", "|---|" + "---|" * len(HEAD)]
    for fam, name in FAMILY.items():
        lines.append(f"| {name} | " + " | ".join(cell(by.get((fam, m))) for m in METHODS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, help="rows of an earlier run (skip the tests)")
    args = ap.parse_args()
    if args.rows is None:
        args.rows = Path(tempfile.mkdtemp()) / "matrix.jsonl"
        if run_tests(args.rows) != 0:
            print("support_matrix: some tests failed; the matrix shows only what passed", file=sys.stderr)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text:
        print(f"support_matrix: README.md has no {BEGIN} marker", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")
    print(f"support_matrix: {len(rows)} rows written to README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
