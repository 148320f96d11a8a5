"""Record the artifact layouts llm-compressor writes for each compressed-tensors preset, as test fixtures.

Runs in llm-compressor's own venv (benchmarks/setup_peers.sh), never in quantkit's:

    /work/peers/llmc/bin/python benchmarks/peer_layouts.py [--family llama qwen3_moe] [--preset W4A16 ...]

For the tiny random Llama and Qwen3-MoE of tests/tiny_models.py (at PEER_SHAPES' widths) and each preset, it runs
oneshot with QuantizationModifier (RTN) and with GPTQModifier, ignoring lm_head (and the MoE routers, as
llm-compressor's Qwen3-MoE examples do), saves compressed, and writes
tests/fixtures/peer_layouts/<family>/<preset>[_gptq].json: every tensor's dtype and shape from the safetensors
headers and the quantization_config (minus its version), no weights. A preset the peer refuses is recorded with
its error. tests/test_peer_layout.py compares quantkit's artifacts against these files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import PEER_SHAPES, WIKI_VALID, make_tiny_model, tiny_tokenizer  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "peer_layouts"
PRESETS = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W4AFP8", "NVFP4A16",
           "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"]
# FP8 KV cache on top of W4A16: the kv_cache_scheme of llm-compressor's examples/quantization_kv_cache
KV_FP8 = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
CASES = PRESETS + ["W4A16_KV_FP8"]
IGNORE = {"llama": ["lm_head"], "qwen3_moe": ["lm_head", "re:.*mlp.gate$"]}
SAMPLES, SEQ_LEN = 8, 64


def calibration(tokenizer):
    """SAMPLES windows of SEQ_LEN tokens of WikiText-2 validation text, already tokenized."""
    from datasets import Dataset

    ids = tokenizer(WIKI_VALID.read_text(encoding="utf-8")[:200_000])["input_ids"]
    step = len(ids) // SAMPLES
    rows = [ids[i * step: i * step + SEQ_LEN] for i in range(SAMPLES)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * SEQ_LEN for _ in rows]})


def safetensors_layout(folder: Path) -> dict[str, list]:
    """name -> [dtype, shape] from every safetensors header in folder (the weights are never read)."""
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        tensors |= {k: [v["dtype"], v["shape"]] for k, v in header.items() if k != "__metadata__"}
    return dict(sorted(tensors.items()))


def quantization_config(folder: Path) -> dict:
    qcfg = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    qcfg.pop("version", None)  # compressed-tensors' package version: not layout
    return qcfg


def dumps(record: dict) -> str:
    """Indented JSON with one line per tensor (diffs of a re-recorded fixture stay readable)."""
    tensors = record.pop("tensors", None)
    text = json.dumps(record, indent=1)
    if tensors is None:
        return text + "\n"
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in tensors.items())
    return f'{text[:-2]},\n "tensors": {{\n{lines}\n }}\n}}\n'


def run_case(model_dir: Path, family: str, case: str, gptq: bool, dataset, out_dir: Path, dtype: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    preset = "W4A16" if case == "W4A16_KV_FP8" else case
    kw = dict(scheme=preset, targets=["Linear"], ignore=IGNORE[family])
    if case == "W4A16_KV_FP8":
        kw["kv_cache_scheme"] = KV_FP8
    modifier = GPTQModifier(**kw, block_size=128, dampening_frac=0.01) if gptq else QuantizationModifier(**kw)
    # MoE experts: oneshot linearizes them after loading (per-expert Linears). Its faster path,
    # load_quantizable_moe, needs torchvision in transformers 5.17 (a CUDA-only wheel on PyPI).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    oneshot(model=model, recipe=modifier, dataset=dataset, num_calibration_samples=SAMPLES,
            max_seq_length=SEQ_LEN, output_dir=str(out_dir), save_compressed=True)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    return f"{cpu}, {os.cpu_count()} cores"


def record_case(model_dir: Path, family: str, case: str, method: str, dtype: str, dataset, work: Path,
                common: dict) -> dict:
    """Quantize one case with the peer and describe what it wrote (or why it refused)."""
    from llmcompressor.core import reset_session

    out_dir = work / f"{family}-{case}-{method}"
    record = dict(family=family, preset=case, method=method, dtype=dtype, shapes=PEER_SHAPES[family],
                  ignore=IGNORE[family]) | common
    t0 = time.perf_counter()
    try:
        reset_session()
        run_case(model_dir, family, case, method == "gptq", dataset, out_dir, dtype)
        record |= dict(accepted=True, quantization_config=quantization_config(out_dir),
                       tensors=safetensors_layout(out_dir))
    except Exception as exc:  # the peer refusing a preset is a result, kept in the fixture
        traceback.print_exc()
        last = (str(exc).strip().splitlines() or [""])[-1]
        record |= dict(accepted=False, error=f"{type(exc).__name__}: {last}"[:500])
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    record["seconds"] = round(time.perf_counter() - t0, 1)  # load + oneshot + save, one process for all cases
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", nargs="+", default=list(PEER_SHAPES))
    ap.add_argument("--preset", nargs="+", default=CASES)
    ap.add_argument("--method", nargs="+", default=["rtn", "gptq"])
    # the dtype the model is loaded (and its unquantized tensors and int scales saved) in; not float32: a _<dtype>
    # suffix on the fixture's name
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    common = dict(calibration=dict(samples=SAMPLES, seq_len=SEQ_LEN),
                  versions={p: metadata.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers",
                                                             "torch")},
                  recorded=dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), machine=machine()))
    dataset = calibration(tiny_tokenizer())
    work = Path(tempfile.mkdtemp(prefix="peer_layouts_"))
    try:
        for family in args.family:
            model_dir = make_tiny_model(work / family, family, **PEER_SHAPES[family])
            for case in args.preset:
                for method in args.method:
                    record = record_case(model_dir, family, case, method, args.dtype, dataset, work, common)
                    suffix = ("_gptq" if method == "gptq" else "") + ("" if args.dtype == "float32" else
                                                                      f"_{args.dtype}")
                    path = OUT / family / f"{case}{suffix}.json"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(dumps(record))
                    print(f"[peer_layouts] {family} {case}{suffix}: "
                          f"{'ok' if record['accepted'] else record['error']} ({record['seconds']} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
