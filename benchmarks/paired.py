#!/usr/bin/env python
"""Is artifact A worse than artifact B on a domain, or is the difference noise? A paired comparison over windows.

Every artifact of one `quantkit report` (or of `quantkit eval --json` files with the same base, windows and
settings) is scored on the same token windows, and each domain's JSON keeps every window's mean NLL and mean KLD
(`per_window`). Two artifacts' windows pair up, so their difference has an error bar from the spread of the per-window
differences, far narrower than either artifact's own: both stay close to the same original, window by window.

Per domain and each artifact against the reference (the first one, or --ref), this prints the perplexity ratio
exp(mean Δ NLL) and the KLD difference, each with a 95 % interval (± 1.96 standard errors of the mean over
windows), and a verdict: `worse` / `better` when the interval excludes zero, else `tie`.

    python benchmarks/paired.py OUT/report.json [more eval JSONs...] [--ref SUBSTRING] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from quantkit.evaluation.distribution import _mean_stderr

Z95 = 1.96


def bodies(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        out += data["results"] if "results" in data else [data]
    return out


def domains(body: dict) -> dict[str, dict]:
    return body.get("domains") or {"main": body}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a - b over windows and its standard error."""
    if len(a) != len(b):
        raise SystemExit(f"error: {len(a)} windows against {len(b)}: the artifacts were not scored on the same windows")
    return _mean_stderr(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))


def verdict(mean: float, se: float) -> str:
    if math.isnan(se):
        return "one window"
    return "worse" if mean - Z95 * se > 0 else "better" if mean + Z95 * se < 0 else "tie"


def compare(ref: dict, other: dict) -> list[dict]:
    rows = []
    for name, d in domains(other).items():
        r = domains(ref).get(name)
        if r is None or "per_window" not in d or "per_window" not in r:
            continue
        dn, dn_se = paired(d["per_window"]["nll_model"], r["per_window"]["nll_model"])
        dk, dk_se = paired(d["per_window"]["kld"], r["per_window"]["kld"])
        rows.append({
            "domain": name, "windows": len(d["per_window"]["kld"]),
            "ppl": d["ppl"]["model"], "ppl_ref": r["ppl"]["model"],
            "ppl_ratio": math.exp(dn), "ppl_ratio_lo": math.exp(dn - Z95 * dn_se),
            "ppl_ratio_hi": math.exp(dn + Z95 * dn_se), "ppl_verdict": verdict(dn, dn_se),
            "kld": d["kld"]["mean"], "kld_ref": r["kld"]["mean"], "kld_diff": dk,
            "kld_diff_lo": dk - Z95 * dk_se, "kld_diff_hi": dk + Z95 * dk_se, "kld_verdict": verdict(dk, dk_se),
        })
    return rows


def markdown(ref: dict, other: dict, rows: list[dict]) -> str:
    lines = [f"`{other['model']}` against `{ref['model']}` (95 % intervals over windows)", "",
             "| domain | windows | ppl | ppl ratio [95 %] | | KLD | KLD diff [95 %] | |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(
            f"| {r['domain']} | {r['windows']} | {r['ppl']:.3f} / {r['ppl_ref']:.3f} | {r['ppl_ratio']:.4f} "
            f"[{r['ppl_ratio_lo']:.4f}, {r['ppl_ratio_hi']:.4f}] | {r['ppl_verdict']} | {r['kld']:.4f} / "
            f"{r['kld_ref']:.4f} | {r['kld_diff']:+.4f} [{r['kld_diff_lo']:+.4f}, {r['kld_diff_hi']:+.4f}] | "
            f"{r['kld_verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="report.json or eval JSON files")
    ap.add_argument("--ref", help="the reference: the artifact whose path contains this (default: the first)")
    ap.add_argument("--markdown", help="also write the tables here")
    args = ap.parse_args(argv)
    results = bodies(args.json)
    if len(results) < 2:
        raise SystemExit("error: need at least two artifacts to compare")
    ref = next((b for b in results if args.ref in b["model"]), None) if args.ref else results[0]
    if ref is None:
        raise SystemExit(f"error: --ref {args.ref}: no artifact path contains it")
    tables = []
    for other in results:
        if other is ref:
            continue
        rows = compare(ref, other)
        if not rows:
            raise SystemExit(f"error: {other['model']}: no domain with per-window results shared with the reference "
                             "(scored by a quantkit older than benchmarks/paired.py, or without --base?)")
        tables.append(markdown(ref, other, rows))
    text = "\n\n".join(tables)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
