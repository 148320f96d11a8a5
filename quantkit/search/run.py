"""`quantkit search RECIPE`: sensitivity measured per fused group and candidate, the exact allocation under the
budget, then the chosen mix quantized end to end like any recipe (GPTQ's error feedback changes the interactions)
and measured on the same text, beside what was predicted. Writes under export.output: search/recipe.yaml (the mix
as a plain recipe), search/search.json, search/pareto.png, search/layers.md, and the artifact in the recipe's
formats."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from pydantic import ValidationError, create_model
from scipy.stats import spearmanr

from .. import runtime
from ..errors import QuantkitError
from ..export import formats as format_registry
from ..export.base import scheme_of
from ..families import moe
from ..files import write_json_atomic, write_text_atomic
from ..model import decoder_blocks, load_model, model_fingerprint, torch_dtype
from ..overrides import block_index
from ..progress import Reporter
from ..quantize import calibration
from ..quantize import targets as target_plan
from ..quantize.capture import capture_block_inputs
from ..quantize.run import recipe_fingerprint, run_quantize
from ..recipe import Recipe, format_validation_error, parse_recipe, read_yaml
from . import allocate, plots, sensitivity, sizes
from .config import Search, check_words, grid_of, label

_Block = create_model("SearchBlock", search=(Search, ...))


def load(path: str) -> tuple[dict, Recipe, Search]:
    """The recipe without its search block (as the chosen recipe starts from it), the recipe, and the block."""
    raw = read_yaml(path)
    if not isinstance(raw, dict) or "search" not in raw:
        raise QuantkitError(f"{path}: search: the recipe has no search block (candidates, budget)")
    block = raw.pop("search")
    recipe = parse_recipe(raw, path)
    check_words(block, path)
    try:
        cfg = _Block.model_validate({"search": block}).search
    except ValidationError as err:
        raise QuantkitError(format_validation_error(err, path)) from None
    if recipe.overrides:
        raise QuantkitError(f"{path}: overrides: the search writes them (search/recipe.yaml); leave them out")
    if recipe.transforms:
        raise QuantkitError(f"{path}: stages: the search takes one weight stage (rtn or gptq); "
                            f"{recipe.transforms[0].name} before it is not searched yet")
    return raw, recipe, cfg


def run_search(path: str, report: Reporter, overwrite: bool = False) -> dict:
    raw, recipe, cfg = load(path)
    stage = recipe.stage
    specs = [grid_of(c, stage.weights, f"{path}: search.candidates.{i}") for i, c in enumerate(cfg.candidates)]
    if len(set(specs)) != len(specs):
        raise QuantkitError(f"{path}: search.candidates: two candidates give the same grid")
    out = Path(recipe.export.output) / "search"
    start = time.perf_counter()
    loaded = load_model(recipe.model, recipe.dtype)
    model = loaded.model
    moe.unfuse(model)
    prefix, blocks = decoder_blocks(model)
    _, targets, info = target_plan.plan(model, stage, recipe.export.formats)
    groups = target_plan.fused_groups(list(targets))
    dtype = next(model.parameters()).dtype if recipe.export.dtype == "auto" else torch_dtype(recipe.export.dtype)
    fmt = recipe.export.formats[0]
    allowed = _fits(groups, targets, specs, recipe.export.formats, path)
    cost = np.array([[sum(sizes.linear_bytes(n, targets[n], s, fmt, info, dtype) for n in g) if ok else 0
                      for s, ok in zip(specs, fits)] for g, fits in zip(groups, allowed)], dtype=np.int64)
    fixed = sizes.fixed_bytes(model, set(targets), dtype)
    budget = _budget(cfg, stage.weights, model, targets, info, fmt, dtype, fixed, path)
    allocate.check_budget(cost, budget, allowed)  # before any work
    report.info(f"search: {len(groups)} groups of {len(targets)} Linears x {len(specs)} candidates "
                f"({', '.join(map(label, specs))}); budget {budget + fixed} bytes")
    for c in np.flatnonzero(~allowed.all(axis=0)):
        report.info(f"search: {label(specs[c])} does not fit {int((~allowed[:, c]).sum())} of {len(groups)} groups "
                    "(its group size does not divide their in_features, or a format cannot pack them); they take the "
                    "other candidates")

    # what the measurements depend on: not the budget (a search is re-run at another budget) nor the refining, but
    # the model's files and the scored tokens (added once they are read)
    key = {"recipe": recipe_fingerprint(recipe), "model": model_fingerprint(recipe.model),
           "search": cfg.model_dump(mode="json", exclude={"budget", "refine"}), "candidates": [label(s) for s in specs],
           "fits": allowed.tolist()}  # which candidates the formats let each group take
    measured, sample = _sensitivity(recipe, cfg, loaded, prefix, blocks, targets, groups, specs, allowed, key, out,
                                    report)
    increase = np.array([[m["increase"][c] or [0.0] * len(sample.domains) for c in range(len(specs))]
                         for m in measured])  # [G, C, D]; a candidate a group cannot take: None, never picked
    with report.timed("allocate"):
        pareto = allocate.front(increase, cost, allowed)
    rounds = _rounds(raw, recipe, stage.name, groups, specs, increase, cost, budget, allowed, cfg.refine, sample,
                     out, overwrite, report)
    best = min(rounds, key=lambda r: max(r["measured"]))
    chosen, got, written, summary = best["choice"], {"domains": sample.domains, "kld": best["measured"]}, \
        best["bytes"], best["summary"]
    artifact = Path(recipe.export.output) / fmt
    body = {
        "recipe": str(path),
        "chosen_recipe": str(out / "recipe.yaml"),
        "artifact": str(artifact),
        "domains": got["domains"],
        "candidates": [label(s) for s in specs],
        "budget_bytes": budget + fixed,
        "fixed_bytes": fixed,
        "predicted": {"bytes": chosen.bytes + fixed, "kld": dict(zip(got["domains"], best["unscaled"])),
                      "worst": max(best["unscaled"])},
        "measured": {"bytes": written, "kld": dict(zip(got["domains"], got["kld"])), "worst": max(got["kld"])},
        "groups": [{"linears": list(g), "choice": label(specs[chosen.pick[gi]]),
                    "bytes": [int(x) if ok else None for x, ok in zip(cost[gi], allowed[gi])], **measured[gi]}
                   for gi, g in enumerate(groups)],
        "pareto": [{"bytes": p.bytes + fixed, "worst": p.worst, "kld": dict(zip(got["domains"], p.predicted)),
                    "mix": _counts(p.pick, specs)} for p in pareto],
        "checks": _agreement(measured),
        "rounds": [{"mix": _counts(r["choice"].pick, specs), "domain_factors": r["factors"],
                    "predicted": dict(zip(sample.domains, r["predicted"])),
                    "predicted_unscaled": dict(zip(sample.domains, r["unscaled"])),
                    "measured": dict(zip(sample.domains, r["measured"])), "bytes": r["bytes"],
                    "kept": r is best} for r in rounds],
        "timings": report.timings | {"total": round(time.perf_counter() - start, 1)},
        "quantize": {k: summary.get(k) for k in ("timings", "formats") if k in summary},
        "decode_speedup": _speedup(model, dtype, written, cfg.budget.decode_speedup),
    }
    write_json_atomic(out / "search.json", body)
    write_text_atomic(out / "layers.md", _layers_table(body))
    plots.pareto(body, out / "pareto.png")
    report.info(f"search: measured worst-domain KLD {body['measured']['worst']:.4f} (predicted "
                f"{max(best['unscaled']):.4f}) at {written} bytes (budget {budget + fixed}), decode "
                f"{body['decode_speedup']['roofline']}x the 16-bit original by the roofline; {out}")
    return body


def _rounds(raw, recipe, method, groups, specs, increase, cost, budget, allowed, refine, sample, out, overwrite,
            report) -> list[dict]:
    """The allocation, its mix quantized and measured; then up to `refine` times the allocation again with each
    domain's increases scaled by its measured / predicted KLD, a new mix quantized and measured. The best measured
    mix's artifact and search/recipe.yaml are left in place (the others' artifacts are removed)."""
    fmts = recipe.export.formats
    root = Path(recipe.export.output)
    factors = np.ones(increase.shape[2])
    rounds: list[dict] = []
    while True:
        with report.timed("allocate"):
            chosen = allocate.allocate(increase * factors, cost, budget, allowed)
        if any(r["choice"].pick == chosen.pick for r in rounds):
            break  # the rescaled allocation chose a mix already measured
        report.info(f"search: predicted worst-domain KLD {chosen.worst:.4f} at {chosen.bytes} bytes of the searched "
                    f"Linears" + (f" (round {len(rounds) + 1}, domain factors "
                                  f"{', '.join(f'{f:.2f}' for f in factors)})" if rounds else ""))
        mix = {n: specs[chosen.pick[gi]] for gi, g in enumerate(groups) for n in g}
        chosen_raw = _chosen_recipe(raw, method, mix)
        text = "# written by quantkit search (search.json has why)\n" + yaml.safe_dump(chosen_raw, sort_keys=False,
                                                                                      width=120)
        write_text_atomic(out / "recipe.yaml", text)
        with report.timed("quantize_mix"):  # the run's own steps are timed under their names beside it
            summary = run_quantize(parse_recipe(chosen_raw, str(out / "recipe.yaml")), overwrite or bool(rounds),
                                   report)
        with report.timed("measure"):
            got = _measure(root / fmts[0], recipe, sample)
        raw_predicted = np.array(allocate.choice(chosen.pick, increase, cost).predicted)  # without the factors
        rounds.append({"choice": chosen, "factors": [float(f) for f in factors], "predicted": chosen.predicted,
                       "unscaled": raw_predicted.tolist(), "measured": got["kld"],
                       "bytes": _written_bytes(root / fmts[0]), "summary": summary, "recipe": text, "aside": False})
        if len(rounds) > refine:
            break
        for f in fmts:  # kept aside until the best is known
            _move(root / f, out / "rounds" / str(len(rounds)) / f)
        rounds[-1]["aside"] = True
        # a domain predicted at ~0 keeps its factor (its ratio says nothing)
        factors = np.where(raw_predicted > 1e-9, np.array(got["kld"]) / np.maximum(raw_predicted, 1e-9), factors)
    best = min(rounds, key=lambda r: max(r["measured"]))
    if best["aside"]:
        for f in fmts:
            shutil.rmtree(root / f, ignore_errors=True)
            _move(out / "rounds" / str(rounds.index(best) + 1) / f, root / f)
        write_text_atomic(out / "recipe.yaml", best["recipe"])
    shutil.rmtree(out / "rounds", ignore_errors=True)
    return rounds


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dst, ignore_errors=True)
    src.rename(dst)


def _fits(groups: list[tuple[str, ...]], targets: dict, specs: list, formats: list[str], path: str) -> np.ndarray:
    """[G, C]: whether every Linear of a group can take a candidate (its group size divides in_features, and each
    format packs it). A group no candidate fits is refused in one line (naming the group size, the usual cause)."""
    def fits(spec, name: str) -> bool:
        m = targets[name]
        if spec is None:
            return True
        if spec.group_size != -1 and m.in_features % spec.group_size:
            return False
        return all(format_registry.get(f).check_linear(scheme_of(spec, None), name, m.out_features,
                                                       m.in_features) is None for f in formats)

    allowed = np.array([[all(fits(s, n) for n in g) for s in specs] for g in groups], dtype=bool)
    for g, ok in zip(groups, allowed):
        if not ok.any():
            raise QuantkitError(f"{path}: search.candidates: none fits {g[0]} (in_features "
                                f"{targets[g[0]].in_features}); add one whose group size divides it, or unquantized")
    return allowed


def _budget(cfg: Search, stage_args, model, targets, info, fmt, dtype, fixed: int, path: str) -> int:
    """Bytes the searched Linears may take together."""
    b = cfg.budget
    if b.weight_bytes is not None:
        if b.weight_bytes <= fixed:
            raise QuantkitError(f"{path}: search.budget.weight_bytes: {b.weight_bytes} bytes; the tensors no "
                                f"candidate changes (embeddings, norms, float Linears) already take {fixed}")
        return b.weight_bytes - fixed
    if b.bits_per_weight is not None:
        return int(b.bits_per_weight * sum(m.weight.numel() for m in targets.values()) / 8)
    if b.decode_speedup is not None:  # the artifact's bytes read per token at most the original's / speedup
        r = roofline(model, dtype)
        allowed, read_fixed = r["original_read_bytes"] / b.decode_speedup, fixed - r["unread_bytes"]
        if allowed <= read_fixed:
            raise QuantkitError(f"{path}: search.budget.decode_speedup: {b.decode_speedup}x allows {int(allowed)} "
                                f"bytes read per token; the tensors no candidate changes already take {read_fixed}")
        return int(allowed - read_fixed)
    spec = grid_of(b.same_bytes_as, stage_args, f"{path}: search.budget.same_bytes_as")
    return sum(sizes.linear_bytes(n, m, spec, fmt, info, dtype) for n, m in targets.items())


def roofline(model, dtype) -> dict:
    """A memory-bound decode step's bytes: the original's in 16-bit, and what an artifact stores but does not read."""
    table = sizes.untied_table(model)
    return {"original_read_bytes": sizes.read_bytes_16bit(model),
            "unread_bytes": 0 if table is None else table.numel() * dtype.itemsize}


def _speedup(model, dtype, written: int, target: float | None) -> dict:
    """The artifact's decode speedup over the original in 16-bit by the roofline: bytes read per token."""
    r = roofline(model, dtype)
    read = written - r["unread_bytes"]
    return {"target": target, "roofline": round(r["original_read_bytes"] / read, 3), "read_bytes": read,
            "original_read_bytes": r["original_read_bytes"],
            "basis": "roofline: weight bytes a memory-bound decode step reads per token (an untied input embedding "
                     "table: one row), against the original's in 16-bit; KV cache and kernels not counted; "
                     "not a measurement"}


def _sensitivity(recipe: Recipe, cfg: Search, loaded, prefix: str, blocks, targets, groups, specs, allowed, key,
                 out: Path, report: Reporter) -> tuple[list[dict], sensitivity.Sample]:
    """Per group: each candidate's output error and KLD increase per domain (measured or scaled), block by block."""
    model, stage = loaded.model, recipe.stage
    with report.timed("score_text"):
        sample = sensitivity.score_sample(cfg, loaded, blocks, recipe.model, recipe.dtype,
                                          recipe.calibration.seed if recipe.calibration else 0, report)
    key = key | {"tokens_sha256": hashlib.sha256(sample.ids.numpy().tobytes()).hexdigest()}
    cache = sensitivity.BlockCache(out / "sensitivity", key)
    # the Hessians solve each candidate (GPTQ) and weigh its output error; without calibration (RTN) the error is
    # the weights' own
    need_data = recipe.calibration is not None
    if need_data:
        cal = calibration.build(loaded.tokenizer, recipe.calibration, recipe.model, recipe.dtype,
                                torch.device("cpu"), report).tokens[:cfg.calibration_samples]
        hidden, _ = capture_block_inputs(model, blocks, cal)
        calls = sensitivity.call_args(model, blocks, cal)
    solver = sensitivity.Solver(stage.weights, stage.method.solves)
    gram = torch.bfloat16 if getattr(stage.weights, "hessian_dtype", "float32") == "bfloat16" else torch.float32
    by_block: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        by_block.setdefault(block_index(g[0], prefix), []).append(gi)
    checks = set(np.linspace(0, len(groups) - 1, cfg.checks).round().astype(int).tolist()) if cfg.checks else set()
    share = sensitivity.shared_inputs(list(targets))
    result: list[dict | None] = [None] * len(groups)
    with torch.no_grad():
        for i in report.steps("search: sensitivity, block", len(blocks)):
            mine = by_block.get(i, [])
            cached = cache.get(i)
            linears = {n: targets[n] for gi in mine for n in groups[gi]}
            if cached is not None:
                for gi, body in zip(mine, cached):
                    result[gi] = body
                if need_data:
                    hidden = sensitivity.block_hessians(blocks[i], {}, share, hidden, calls[i], gram)[1]
                continue
            hess = {}
            if need_data:
                hess, hidden = sensitivity.block_hessians(blocks[i], linears, share, hidden, calls[i], gram)
                hess = {n: h.value() for n, h in hess.items()}
            bodies = []
            for gi in mine:
                bodies.append(_group(groups[gi], targets, share, hess, specs, allowed[gi], solver, stage.method,
                                     model, blocks, i, sample, cfg.measure == "all" or gi in checks))
                result[gi] = bodies[-1]
            cache.put(i, bodies)
    return result, sample  # type: ignore[return-value]


def _group(names, targets, share, hess, specs, allowed, solver, method, model, blocks, i, sample, measure_all
           ) -> dict:
    """A candidate the group cannot take has error and increase None."""
    originals = {n: targets[n].weight.data for n in names}
    candidates: list[dict[str, torch.Tensor] | None] = []
    errors: list[float | None] = []
    for spec, ok in zip(specs, allowed):
        if spec is None or not ok:
            candidates.append(None)
            errors.append(0.0 if ok else None)
            continue
        deq: dict[str, torch.Tensor] = {}
        readers: dict[str, list[str]] = {}
        for n in names:
            readers.setdefault(share[n], []).append(n)
        err = 0.0
        for first, members in readers.items():
            h = hess.get(first)
            h = h if h is not None else torch.eye(originals[first].shape[1])
            ws = solver.weights([originals[n] for n in members], h, spec, method, first)
            for n, q in zip(members, ws):
                deq[n] = q
                err += sensitivity.output_error(originals[n], q, h)
        candidates.append(deq)
        errors.append(err)
    lossy = [c for c, s in enumerate(specs) if s is not None and allowed[c]]
    if not lossy:  # only unquantized fits: nothing to measure
        return {"errors": errors, "reference": None, "increase": [[0.0] * len(sample.domains) if e is not None
                                                                   else None for e in errors], "checked": {}}
    ref = max(lossy, key=lambda c: errors[c])
    measured: dict[int, list[float]] = {}
    for c in (lossy if measure_all else [ref]):
        for n in names:
            targets[n].weight.data = candidates[c][n]
        try:
            measured[c] = sensitivity.tail_kld(model, blocks, i, sample)
        finally:
            for n in names:
                targets[n].weight.data = originals[n]
    def scaled(c: int) -> list[float]:  # the reference's increase, scaled by candidate c's output error
        return [max(x, 0.0) * (errors[c] / errors[ref] if errors[ref] > 0 else 0.0) for x in measured[ref]]

    increase = [None if not allowed[c] else [0.0] * len(sample.domains) if spec is None
                else [max(x, 0.0) for x in measured[c]] if c in measured else scaled(c)
                for c, spec in enumerate(specs)]
    return {"errors": errors, "reference": ref, "increase": increase,
            "checked": {str(c): {"measured": measured[c], "scaled": scaled(c)} for c in measured if c != ref}}


def _chosen_recipe(raw: dict, method: str, mix: dict[str, object]) -> dict:
    """The recipe as written, its weight stage at the grid most Linears take, and an override per other grid naming
    its Linears."""
    counts: dict[object, int] = {}
    for spec in mix.values():
        counts[spec] = counts.get(spec, 0) + 1
    default = max((s for s in counts if s is not None), key=lambda s: counts[s], default=None)
    if default is None:
        raise QuantkitError("search: the budget left every Linear unquantized; lower the budget")
    out = {k: v for k, v in raw.items()}
    stages = [dict(s) for s in raw["stages"]]
    args = dict(stages[-1][method] or {})
    args.update(bits=default.bits, group_size=default.group_size, sym=default.sym)
    args.pop("scheme", None)  # a preset's grid would fight the one written out
    stages[-1] = {method: args}
    out["stages"] = stages
    overrides = []
    for spec in sorted((s for s in counts if s != default), key=lambda s: (s is None, label(s))):
        names = sorted(n for n, s in mix.items() if s == spec)
        grid = {"unquantized": True} if spec is None else {"bits": spec.bits, "group_size": spec.group_size,
                                                             "sym": spec.sym}
        overrides.append({"targets": names, **grid})
    if overrides:
        out["overrides"] = overrides
    return out


def _written_bytes(artifact: Path) -> int:
    return sum(f.stat().st_size for f in artifact.glob("*.safetensors"))


def _measure(artifact: Path, recipe: Recipe, sample: sensitivity.Sample) -> dict:
    """The artifact's KLD per domain on the scored text, run by quantkit's runtime."""
    quant = runtime.load(str(artifact), recipe.dtype)
    with torch.no_grad():
        kld = sample.kld(quant.model(input_ids=sample.ids, use_cache=False).logits)
    return {"domains": sample.domains, "kld": kld}


def _counts(pick: list[int], specs) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in pick:
        out[label(specs[c])] = out.get(label(specs[c]), 0) + 1
    return out


def _agreement(measured: list[dict]) -> dict:
    """How the scaled increases compare with measured ones where both exist (the check groups)."""
    pairs = [(s, m) for g in measured for c in g["checked"].values()
             for s, m in zip(c["scaled"], c["measured"]) if m > 0]
    if not pairs:
        return {"pairs": 0}
    s, m = np.array(pairs).T
    return {"pairs": len(pairs), "median_ratio_scaled_to_measured": float(np.median(s / m)),
            "spearman": float(spearmanr(s, m).statistic) if len(pairs) > 2 else None}


def _layers_table(body: dict) -> str:
    domains = body["domains"]
    lines = ["| Linears | grid | " + " | ".join(f"ΔKLD {d}" for d in domains) + " |",
             "| --- | --- | " + " | ".join("---" for _ in domains) + " |"]
    cands = body["candidates"]
    for g in body["groups"]:
        inc = g["increase"][cands.index(g["choice"])]
        lines.append(f"| {', '.join(g['linears'])} | {g['choice']} | " + " | ".join(f"{x:.5f}" for x in inc) + " |")
    return "\n".join(lines) + "\n"


