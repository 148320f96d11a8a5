"""Release gates: what the recipe requires of the measurements, checked against an eval and a bench result.

A gate whose measurement is missing fails ("not measured"): a gate that silently passes because nothing was
measured would let a broken release through."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .recipe import Gates, QualityGates

LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "byte_perplexity")
MAIN_METRICS = ("acc", "acc_norm", "exact_match", "word_perplexity")


@dataclass
class GateResult:
    name: str
    measured: float | None
    required: float
    op: str  # ">=" or "<="
    passed: bool
    detail: str = ""


def _check(name: str, measured: float | None, op: str, required: float, detail: str = "") -> GateResult:
    if measured is None or measured != measured:
        return GateResult(name, None, required, op, False, f"{detail}, not measured" if detail else "not measured")
    ok = measured >= required if op == ">=" else measured <= required
    return GateResult(name, measured, required, op, ok, detail)


def is_lower_better(metric: str) -> bool:
    return any(t in metric for t in LOWER_IS_BETTER)


def task_quality_ratio(task: dict) -> tuple[str, float | None, float | None]:
    """(metric, model score, model/base quality ratio) for a task result of `quantkit eval`: the first main metric
    present (lm-eval names some with a filter, e.g. `exact_match,strict-match`); for lower-is-better metrics the
    ratio is base/model, so 'min_ratio' always means 'keeps this much'."""
    model, base = task.get("model") or {}, task.get("base") or {}
    metric = next((k for m in MAIN_METRICS for k in model if k.split(",")[0] == m), None)
    if metric is None:
        return "?", None, None
    score, ref = model[metric], base.get(metric)
    if ref is None or score is None or ref == 0 or score == 0:
        return metric, score, None
    return metric, score, (ref / score if is_lower_better(metric) else score / ref)


def _speed(bench: dict | None, artifact: str | None, batch: int, key: str) -> float | None:
    for r in (bench or {}).get("ratios", []):  # quantkit's bench: eager runs per batch; vLLM's: per concurrency
        if r.get("variant", "eager") == "eager" and r.get("batch", r.get("concurrency")) == batch and \
                (artifact is None or r["path"] == artifact):
            return r[key]
    return None


def _quality(gates: Gates, domains: dict[str, dict]) -> list[GateResult]:
    """Each quality gate on every domain (per_domain values replace the defaults there), named `gate[domain]`. A
    per_domain entry for a domain that was not evaluated fails as not measured."""
    out = []
    for d in [*domains, *(d for d in gates.per_domain if d not in domains)]:
        m, own = domains.get(d, {}), gates.per_domain.get(d)
        g = gates.model_dump(include=set(QualityGates.model_fields))
        if own is not None:
            g |= {k: v for k, v in own.model_dump().items() if v is not None}
        ppl = m.get("ppl") or {}
        if g["ppl_increase_pct"] is not None:
            inc = 100 * (ppl["model"] / ppl["base"] - 1) if ppl.get("model") and ppl.get("base") else None
            out.append(_check(f"ppl_increase_pct[{d}]", inc, "<=", g["ppl_increase_pct"]))
        if g["kld_mean_max"] is not None:
            out.append(_check(f"kld_mean_max[{d}]", (m.get("kld") or {}).get("mean"), "<=", g["kld_mean_max"]))
        if g["same_top_min"] is not None:
            out.append(_check(f"same_top_min[{d}]", m.get("same_top"), ">=", g["same_top_min"]))
    return out


def evaluate(gates: Gates, eval_body: dict | None, bench: dict | None, artifact: str | None = None) -> list[GateResult]:
    ev = eval_body or {}
    # an eval JSON without domains is one domain; no eval at all still lists the gates, failing as not measured
    out = _quality(gates, ev.get("domains") or {ev.get("dataset", "eval"): ev})
    for task, g in gates.tasks.items():
        metric, score, ratio = task_quality_ratio((ev.get("tasks") or {}).get(task, {}))
        if g.min_ratio is not None:
            out.append(_check(f"tasks.{task}.min_ratio", ratio, ">=", g.min_ratio, metric))
        if g.min is not None:
            if is_lower_better(metric):  # a floor on a perplexity would pass a worse model
                out.append(GateResult(f"tasks.{task}.min", score, g.min, ">=", False,
                                      f"{metric} is lower-is-better: gate it with max"))
            else:
                out.append(_check(f"tasks.{task}.min", score, ">=", g.min, metric))
        if g.max is not None:
            out.append(_check(f"tasks.{task}.max", score, "<=", g.max, metric))
    b = gates.speed_batch
    if gates.decode_speedup_min is not None:
        out.append(_check("decode_speedup_min", _speed(bench, artifact, b, "decode_speedup"), ">=",
                          gates.decode_speedup_min, f"batch {b}"))
    if gates.prefill_speedup_min is not None:
        out.append(_check("prefill_speedup_min", _speed(bench, artifact, b, "prefill_speedup"), ">=",
                          gates.prefill_speedup_min, f"batch {b}"))
    if gates.weight_bytes_ratio_max is not None:
        out.append(_check("weight_bytes_ratio_max", _speed(bench, artifact, b, "weight_bytes_ratio"), "<=",
                          gates.weight_bytes_ratio_max))
    return out


def table(results: list[GateResult]) -> str:
    """Plain, parseable: one gate per line, fixed columns."""
    rows = [("gate", "measured", "required", "result")]
    for r in results:
        measured = "-" if r.measured is None else f"{r.measured:.4g}"
        result = "pass" if r.passed else "FAIL"
        rows.append((r.name + (f" ({r.detail})" if r.detail else ""), measured, f"{r.op} {r.required:g}", result))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def summary(results: list[GateResult]) -> dict:
    return {"passed": all(r.passed for r in results), "results": [asdict(r) for r in results]}


def markdown(results: list[GateResult]) -> str:
    lines = ["| gate | measured | required | result |", "|---|---:|---:|---|"]
    for r in results:
        measured = "not measured" if r.measured is None else f"{r.measured:.4g}"
        lines.append(f"| {r.name}{f' ({r.detail})' if r.detail else ''} | {measured} | {r.op} {r.required:g} "
                     f"| {'pass' if r.passed else '**FAIL**'} |")
    return "\n".join(lines)



