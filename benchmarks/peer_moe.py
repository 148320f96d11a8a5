#!/usr/bin/env python
"""GPTQ W4A16 on a mixture-of-experts model: quantkit vs llm-compressor 0.14, side by side in one run.

The model is a random Qwen3-MoE with real work in it (8 experts, top-2, hidden 512, expert width 512, 4 layers;
the tests' tiny BPE tokenizer), saved once with save_pretrained, i.e. with per-expert tensors as a hub checkpoint
has them. Both tools get the same calibration windows (quantkit's own, saved for the peer), the same grid
(4-bit symmetric, group 128, no act-order, damp 0.01, block 128) and calibrate every expert on every token (both
defaults). Each quantizes in its own process (wall time and peak RSS from wait4, imports to saved artifact).

Both artifacts are then scored by one evaluator in this interpreter: quantkit's runtime loads each compressed-tensors
folder, and the error is measured against the float model on held-back windows that neither tool calibrated on:
logits MSE and KL(float || quantized) per token.

    bash benchmarks/setup_peers.sh                   # once: /work/peers/llmc
    python benchmarks/peer_moe.py                    # 32 x 512 calibration, 16 x 512 held back
    python benchmarks/peer_moe.py --samples 8        # smoke

Writes into --out-dir (default out/peer-moe): the model, calib.pt / heldout.pt, one folder per tool, logs/,
results.json and results.md. Only the standard library is imported at module level: the same file runs the
llm-compressor worker inside its venv (`python peer_moe.py _worker CONFIG.json`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from peer_gptq import run_measured  # noqa: E402  (wall time + peak RSS of one child, via wait4)

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1024, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=2048, tie_word_embeddings=False)
GRID = {"bits": 4, "group_size": 128, "sym": True, "damp": 0.01, "block_size": 128}


def worker(cfg_path: str) -> None:
    """llm-compressor 0.14 in its own venv: oneshot + GPTQModifier -> compressed-tensors."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads(Path(cfg_path).read_text())
    ids = torch.load(cfg["calib"])
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * n})
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    weights = {"num_bits": GRID["bits"], "type": "int", "symmetric": GRID["sym"], "strategy": "group",
               "group_size": GRID["group_size"]}
    recipe = GPTQModifier(targets="Linear", ignore=["lm_head", "re:.*mlp.gate$"],
                          config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                          dampening_frac=GRID["damp"], block_size=GRID["block_size"], actorder=None)
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, max_seq_length=seq_len,
            num_calibration_samples=n, shuffle_calibration_samples=False, moe_calibrate_all_experts=True)
    quantize_s = time.perf_counter() - t0
    model.save_pretrained(cfg["out"], save_compressed=True)
    tok.save_pretrained(cfg["out"])
    Path(cfg["result"]).write_text(json.dumps({"quantize_s": quantize_s}))


def make_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import tiny_tokenizer

    folder = out / "qwen3-moe-random"
    if (folder / "config.json").is_file():
        return folder
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", vocab_size=len(tok), **SHAPE),
                                             dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def windows(folder: Path, samples: int, seq_len: int, seed: int):
    from quantkit.model import load_tokenizer
    from quantkit.quantize.calibration import build
    from quantkit.recipe import Calibration

    return build(load_tokenizer(str(folder)), Calibration(num_samples=samples, seq_len=seq_len, seed=seed)).tokens


def score(folder: Path, model_dir: Path, heldout) -> dict:
    import torch

    from quantkit import runtime
    from quantkit.model import load_model

    base = load_model(str(model_dir), "float32").model
    base.config._experts_implementation = "eager"
    quant = runtime.load(str(folder), "float32").model
    mse = kl = 0.0
    with torch.no_grad():
        for x in heldout.split(4):
            ref, got = base(x).logits.float(), quant(x).logits.float()
            mse += float((ref - got).square().mean()) * len(x)
            lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
            kl += float((lp.exp() * (lp - lq)).sum(-1).mean()) * len(x)
    return {"logits_mse": mse / len(heldout), "kl": kl / len(heldout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=REPO / "out" / "peer-moe")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--llmc-python", default="/work/peers/llmc/bin/python")
    args = ap.parse_args()
    import torch

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(out)
    calib = windows(model_dir, args.samples, args.seq_len, seed=0)
    heldout = windows(model_dir, args.heldout, args.seq_len, seed=1234)
    torch.save(calib, out / "calib.pt")
    recipe = out / "quantkit.yaml"
    recipe.write_text(
        f"model: {model_dir}\ndtype: float32\ndevice: cpu\nload: memory\n"
        f"calibration: {{dataset: wikitext2, num_samples: {args.samples}, seq_len: {args.seq_len}, seed: 0}}\n"
        "moe: {calibrate_all_experts: true}\n"
        f"stages:\n  - gptq: {{bits: {GRID['bits']}, group_size: {GRID['group_size']}, sym: true, act_order: false, "
        f"damp: {GRID['damp']}, block_size: {GRID['block_size']}}}\n"
        f"export: {{output: {out / 'quantkit'}, formats: [compressed-tensors]}}\n")
    cfg = out / "llmc.json"
    cfg.write_text(json.dumps({"model": str(model_dir), "calib": str(out / "calib.pt"), "out": str(out / "llmc"),
                               "result": str(out / "llmc-result.json")}))
    import os

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    runs = {
        "quantkit": run_measured([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--overwrite",
                                  "--quiet", "--json", str(out / "quantkit-result.json")],
                                 out / "logs" / "quantkit.log", env, 0),
        "llm-compressor": run_measured([args.llmc_python, str(HERE), "_worker", str(cfg)],
                                       out / "logs" / "llmc.log", env, 0),
    }
    folders = {"quantkit": out / "quantkit" / "compressed-tensors", "llm-compressor": out / "llmc"}
    results = {"shape": SHAPE, "grid": GRID, "calibration": list(calib.shape), "heldout": list(heldout.shape)}
    for tool, run in runs.items():
        results[tool] = run | (score(folders[tool], model_dir, heldout) if run["rc"] == 0 else {})
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    q, p = results["quantkit"], results["llm-compressor"]
    lines = ["| tool | wall s | peak RSS MB | logits MSE | KL |", "|---|---:|---:|---:|---:|"]
    for tool in ("quantkit", "llm-compressor"):
        r = results[tool]
        lines.append(f"| {tool} | {r['wall_s']} | {r['peak_rss_mb']} | {r.get('logits_mse', float('nan')):.4g} | "
                     f"{r.get('kl', float('nan')):.4g} |")
    if q["rc"] == 0 and p["rc"] == 0:
        lines.append(f"\nquantkit / llm-compressor: wall {q['wall_s'] / p['wall_s']:.2f}x, "
                     f"logits MSE {q['logits_mse'] / p['logits_mse']:.3f}x, KL {q['kl'] / p['kl']:.3f}x")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if q["rc"] == 0 and p["rc"] == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        worker(sys.argv[2])
    else:
        raise SystemExit(main())
