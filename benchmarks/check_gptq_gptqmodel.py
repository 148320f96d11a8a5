"""Independent check of a quantkit `gptq` artifact: load it with GPTQModel (the loader transformers uses
for GPTQ checkpoints; torch backend, CPU) and compare with quantkit's runtime.

    python benchmarks/check_gptq_gptqmodel.py out/smollm2-135m-gptq-w4a16/gptq [--python /work/peers/gptqmodel/bin/python]

Two comparisons: every quantized Linear's dequantized weight (GPTQModel's TorchLinear.dequantize_weight
vs quantkit's, both float16), and the logits on a fixed batch of WikiText-2 tokens (GPTQModel in float16,
quantkit's runtime in float32 and in float16). GPTQModel runs in its own venv (benchmarks/setup_peers.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def worker(folder: str, tokens_path: str, out_path: str) -> None:
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(folder, backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    weights, kinds = {}, set()
    for name, module in model.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
            kinds.add(type(module).__name__)
            w = module.dequantize_weight()
            weights[name] = (w.T if w.shape[0] == module.in_features else w).to(torch.float16).contiguous()
    tokens = torch.load(tokens_path)
    with torch.no_grad():
        logits = model.model(input_ids=tokens).logits.float()
    torch.save({"weights": weights, "logits": logits, "class": sorted(kinds)}, out_path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--python", default="/work/peers/gptqmodel/bin/python")
    ap.add_argument("--worker", nargs=2, metavar=("TOKENS", "OUT"))
    args = ap.parse_args()
    if args.worker:
        worker(args.artifact, *args.worker)
        return 0

    from quantkit import runtime
    from quantkit.evaluation.perplexity import eval_tokens

    ours = runtime.load(args.artifact)
    tokens = eval_tokens(ours.tokenizer, "wikitext2", 4 * 256).view(4, 256)
    with tempfile.TemporaryDirectory() as tmp:
        tok_path, out_path = f"{tmp}/tokens.pt", f"{tmp}/gptqmodel.pt"
        torch.save(tokens, tok_path)
        env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", TORCH_COMPILE_DISABLE="1")
        subprocess.run([args.python, __file__, args.artifact, "--worker", tok_path, out_path], check=True, env=env)
        theirs = torch.load(out_path)
    state = ours.model.state_dict()
    mismatched = [n for n, w in theirs["weights"].items() if not torch.equal(w, state[f"{n}.weight"].half())]
    with torch.no_grad():
        ref32 = ours.model(input_ids=tokens).logits.float()
        ref16 = runtime.load(args.artifact, "float16").model(input_ids=tokens).logits.float()
    result = {
        "artifact": args.artifact,
        "gptqmodel_layer_class": theirs["class"],
        "modules_compared": len(theirs["weights"]),
        "weights_bit_identical_fp16": not mismatched,
        "mismatched_modules": mismatched[:5],
        "logits_max_abs_diff_vs_quantkit_fp16": float((theirs["logits"] - ref16).abs().max()),
        "logits_max_abs_diff_vs_quantkit_fp32": float((theirs["logits"] - ref32).abs().max()),
        "top1_agreement_vs_quantkit_fp32": float((theirs["logits"].argmax(-1) == ref32.argmax(-1)).float().mean()),
    }
    print(json.dumps(result, indent=2))
    return 0 if result["weights_bit_identical_fp16"] and result["top1_agreement_vs_quantkit_fp32"] > 0.97 else 1


if __name__ == "__main__":
    sys.exit(main())
