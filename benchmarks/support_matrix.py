"""README's support matrices, generated from the tests: runs tests/test_families.py (every family x method on a tiny
random model of that family) and tests/test_family_schemes.py (every family x 2026 scheme) with QUANTKIT_MATRIX set,
so each passing test writes what it checked, and renders those rows between the support-matrix and scheme-matrix
markers in README.md.

    python benchmarks/support_matrix.py            # ~9 min on 2 cores
    python benchmarks/support_matrix.py --rows F   # render from an earlier run's rows (JSON lines) without testing
                                                   # (a table none of whose columns has a row stays as it is)
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
MARKERS = {"methods": ("<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"),
           "schemes": ("<!-- scheme-matrix:begin -->", "<!-- scheme-matrix:end -->")}
METHODS = ["rtn", "gptq", "awq", "awq+gptq", "smoothquant+gptq w8a8", "fp8"]
SCHEMES = ["NVFP4", "MXFP4", "MXFP8", "W4AFP8", "FP8 static"]  # tests/test_family_schemes.py's columns
HEAD = ["RTN W4", "GPTQ W4", "AWQ W4", "AWQ+GPTQ W4", "SmoothQuant+GPTQ W8A8 int8", "FP8 W8A8"]
SHORT = {"compressed-tensors": "CT", "gptq": "gptq", "awq": "awq"}
FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma 2",
          "gemma3_text": "Gemma 3", "phi3": "Phi-3", "granite": "Granite", "olmo2": "OLMo 2", "opt": "OPT",
          "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE",
          "deepseek_v3": "DeepSeek-V3"}


def run_tests(rows: Path) -> int:
    env = dict(os.environ, QUANTKIT_MATRIX=str(rows))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_families.py"), str(ROOT / "tests" / "test_family_schemes.py")],
                           env=env, cwd=ROOT)


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
    if "relative_error" in row:  # a scheme's: the logits' squared error over their mean square
        text = f"{q} · {100 * row['relative_error']:.2g} %"
    return text


def render(rows: list[dict], columns: list[str], head: list[str]) -> str:
    by = {(r["family"], r["method"]): r for r in rows}
    lines = ["| family | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for fam, name in FAMILY.items():
        lines.append(f"| {name} | " + " | ".join(cell(by.get((fam, m))) for m in columns) + " |")
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
    for table, (columns, head) in {"methods": (METHODS, HEAD), "schemes": (SCHEMES, SCHEMES)}.items():
        if not any(r["method"] in columns for r in rows):  # --rows from one test file: its table only
            continue
        begin, end = MARKERS[table]
        if begin not in text:
            print(f"support_matrix: README.md has no {begin} marker", file=sys.stderr)
            return 1
        before, rest = text.split(begin, 1)
        _, after = rest.split(end, 1)
        text = f"{before}{begin}\n{render(rows, columns, head)}\n{end}{after}"
    readme.write_text(text)
    print(f"support_matrix: {len(rows)} rows written to README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
