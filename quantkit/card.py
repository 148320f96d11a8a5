"""The model card (README.md) `quantkit release` writes into every artifact folder: what was quantized how, the
measured quality and speed with device and versions, the gates, the files' hashes and how to load it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from . import gates as gate_checks
from .export import formats
from .export.artifact import MANIFEST_NAME, sha256_file
from .files import write_json_atomic, write_text_atomic
from .recipe import Recipe

def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _quality(ev: dict | None) -> list[str]:
    if not ev:
        return ["Not evaluated."]
    engine = ev.get("engine") or {"name": "quantkit"}
    where = (f"Measured in vLLM {engine.get('version')} ({ev.get('dtype')}; the original in quantkit's runtime). "
             if engine["name"] == "vllm" else "Measured in quantkit's runtime. ")
    if engine.get("warning"):
        where = f"**Warning:** {engine['warning']}. " + where
    lines = [where + f"Every domain's text in windows of {ev.get('seq_len')} tokens; KLD against the original's full "
             f"next-token distributions (top-{ev.get('top_k', '?')} + rest). `self` is text the original wrote.", "",
             "| domain | tokens | perplexity | original | KLD mean ± stderr | KLD p99 | same top-1 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for d, m in (ev.get("domains") or {}).items():
        ppl, kld = m.get("ppl", {}), m.get("kld") or {}
        lines.append(f"| {d} | {m.get('tokens', '?')} | {ppl.get('model', float('nan')):.4f} | "
                     f"{ppl.get('base', float('nan')):.4f} | "
                     + (f"{kld['mean']:.5f} ± {kld['stderr']:.5f} | {kld['p99']:.4f} | {100 * m['same_top']:.2f} % |"
                        if kld else "- | - | - |"))
    extra = []
    for task, t in (ev.get("tasks") or {}).items():
        metric, score, ratio = gate_checks.task_quality_ratio(t)
        base = (t.get("base") or {}).get(metric)
        extra.append(f"| {task} {metric} | {_num(score)} | {_num(base)} |")
    if ev.get("generation"):
        g = ev["generation"]
        extra.append(f"| greedy generation token agreement | {100 * g['token_agreement']:.1f} % | 100 % |")
    if extra:
        lines += ["", "| metric | this artifact | original |", "|---|---:|---:|", *extra]
    return lines


def _serving(bench: dict, artifact: str) -> list[str]:
    s = bench["settings"]
    lines = [f"Served by vLLM {bench['engine']['version']}: {s['prompt_len']}-token prompts, {s['gen_len']} generated "
             f"tokens per request, median of {s['reps']} runs.", "",
             "| model | dtype | concurrent requests | output tok/s | TTFT p50 ms | ITL p50 ms | decode tok/s per "
             "sequence | weights MB | KV capacity (sequences) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in bench["runs"]:
        name = "this artifact" if r["name"] == "model" else "original"
        lines.append(f"| {name} | {r['dtype']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {r['ttft_ms']['p50']:.0f} "
                     f"| {r['itl_ms']['p50']:.1f} | {r['decode_tok_s_per_seq']:.1f} | {r['weight_bytes'] / 1e6:.1f} "
                     f"| {r['kv_capacity_sequences']} |")
    for q in bench.get("ratios", []):
        if q["path"] == artifact:
            lines.append(f"\n{q['concurrency']} concurrent: throughput {q['throughput_speedup']:.2f}×, decode "
                         f"{q['decode_speedup']:.2f}× the original's in vLLM; weights {100 * q['weight_bytes_ratio']:.1f} %.")
    run = next(r for r in bench["runs"] if r["name"] == "model")
    return lines + ["", "Reproduce: `vllm serve {} --dtype {} --max-model-len {}`.".format(
        artifact, run["dtype"], s["prompt_len"] + s["gen_len"])]


def _speed(bench: dict | None, artifact: str) -> list[str]:
    if not bench:
        return ["Not benchmarked."]
    if (bench.get("engine") or {}).get("name") == "vllm":
        return _serving(bench, artifact)
    mb = 1e6
    lines = [f"Device: {bench['device_name']}; prompt {bench['settings']['prompt_len']} tokens, "
             f"{bench['settings']['gen_len']} generated, median of {bench['settings']['reps']}.", "",
             "| model | batch | prefill tok/s | decode tok/s | ms/token | weights MB | peak memory MB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in bench["runs"]:
        if r["variant"] != "eager":
            continue
        name = "this artifact" if r["name"] == "model" else "original"
        lines.append(f"| {name} | {r['batch']} | {r['prefill_tok_s']['median']:.0f} | {r['decode_tok_s']['median']:.1f} "
                     f"| {r['ms_per_token']['median']:.2f} | {r['weight_bytes'] / mb:.1f} | {r['peak_mem_bytes'] / mb:.0f} |")
    for q in bench.get("ratios", []):
        if q["path"] == artifact and q["variant"] == "eager":
            lines.append(f"\nBatch {q['batch']}: decode {q['decode_speedup']:.2f}×, prefill {q['prefill_speedup']:.2f}× "
                         f"the original; weights {100 * q['weight_bytes_ratio']:.1f} % of its size.")
    kernels = "; ".join(f"{m['name']}: " + ", ".join(f"{k} ×{n}" for k, n in m["kernels"].items())
                        for m in bench.get("models", []))
    return lines + ["", f"Kernels: {kernels}."]


def _mix(recipe: Recipe) -> list[str]:
    """Per-layer grids of a mixed recipe (overrides, as `quantkit search` writes them): each grid's Linears by kind
    and decoder block."""
    if not recipe.overrides:
        return []
    w = recipe.stage.weights
    lines = ["## Per-layer grids", "", f"Every quantized Linear not listed: {w.bits} bits, group {w.group_size}, "
             f"{'symmetric' if w.sym else 'asymmetric'}.", "", "| grid | Linears (decoder blocks) |", "|---|---|"]
    for o in recipe.overrides:
        grid = "float" if o.unquantized else ", ".join(f"{k} {getattr(o, k)}" for k in ("bits", "group_size", "sym")
                                                        if getattr(o, k) is not None)
        kinds: dict[str, list[str]] = {}
        for t in o.targets:
            m = re.fullmatch(r".*?\.(\d+)\.(.+)", t)
            kind = re.sub(r"experts\.\d+\.", "experts.*.", m[2]) if m else t  # one row for a layer's experts
            blocks = kinds.setdefault(kind, [])
            if m and m[1] not in blocks:
                blocks.append(m[1])
            elif not m:
                blocks.append("")
        shown = "; ".join(f"{k} ({', '.join(b for b in blocks if b)})" if any(blocks) else k
                          for k, blocks in kinds.items())
        lines.append(f"| {grid} | {shown}{' in blocks ' + str(o.layers) if o.layers is not None else ''} |")
    return lines + [""]


def card(recipe: Recipe, folder: Path, report: dict, results: list[gate_checks.GateResult]) -> str:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    fmt = manifest.get("format", folder.name)
    calib = manifest.get("calibration")
    stages = " + ".join(s.name for s in recipe.stages)
    measured = Path(report["artifact"]).name == folder.name
    passed = all(r.passed for r in results)
    lines = [
        f"# {Path(recipe.export.output).name} ({fmt})", "",
        f"`{recipe.model}` quantized with quantkit {manifest.get('quantkit_version')}: {stages}; format `{fmt}`.", "",
        "## Recipe", "", "```yaml",
        yaml.safe_dump(recipe.model_dump(mode="json", exclude={"release", "gates"}, exclude_none=True), sort_keys=False).rstrip(), "```", "",
        *_mix(recipe),
        "## Calibration", "",
        (f"{calib['num_samples']} × {calib['seq_len']} tokens from {calib['source']}, sha256 `{calib['sha256']}`."
         if calib else "None (round-to-nearest needs no data)."), "",
    ]
    if measured:
        lines += ["## Quality against the original", "", *_quality(report.get("eval")), "",
                  "## Speed and memory", "", *_speed(report.get("bench"), report["artifact"]), "",
                  f"## Release gates: {'passed' if passed else 'FAILED'}", "",
                  gate_checks.markdown(results) if results else "No gates declared.", ""]
    else:
        lines += [f"Quality and speed were measured on the `{Path(report['artifact']).name}` artifact of the same "
                  "weights (same quantized values, another file layout); see its README.md.", ""]
    lines += ["## Load it", ""]
    for engine, snippet in formats.get(fmt).loaders:
        lines.append(f"- {engine}: `{snippet.format(path=folder)}`")
    lines += [f"- quantkit: `quantkit eval {folder} --base {recipe.model}`", "", "## Files", "",
              "| file | sha256 |", "|---|---|"]
    lines += [f"| {name} | `{digest}` |" for name, digest in manifest.get("files", {}).items() if name != "README.md"]
    if recipe.release.sign_key:
        lines += ["", "Signed with OpenSSF model-signing: `model.sig` covers every file, this card included. Check it "
                  f"with `quantkit verify {folder} --public-key PUBLIC_KEY.pem`."]
    versions = ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items())
    lines += ["", f"Versions: {versions}.", ""]
    return "\n".join(lines)


def write_cards(recipe: Recipe, root: Path, report: dict, results: list[gate_checks.GateResult]) -> list[Path]:
    """README.md into every artifact folder; its hash joins the manifest's file list (written by rename)."""
    out = []
    for fmt in recipe.export.formats:
        folder = root / fmt
        path = write_text_atomic(folder / "README.md", card(recipe, folder, report, results))
        manifest_path = folder / MANIFEST_NAME
        manifest = json.loads(manifest_path.read_text())
        manifest["files"]["README.md"] = sha256_file(path)  # a crash before this line: the next release rewrites both
        write_json_atomic(manifest_path, manifest)
        out.append(path)
    return out
