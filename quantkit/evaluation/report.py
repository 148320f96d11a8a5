"""Markdown tables and PNG plots from `quantkit eval` results (the JSON dicts runner.evaluate returns)."""

from __future__ import annotations

from pathlib import Path


def _f(x, digits=4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _name(body: dict) -> str:
    """An explicit name, else the artifact folder (`out/NAME/<format>` -> `NAME/<format>`)."""
    if body.get("name"):
        return body["name"]
    path = Path(body["model"])
    return f"{path.parent.name}/{path.name}" if path.name == body.get("format") else (path.name or body["model"])


def _task_metric(scores: dict) -> str | None:
    for m in ("acc", "word_perplexity", "acc_norm", "perplexity"):
        if m in scores:
            return m
    return next((m for m in scores if not m.endswith("_stderr") and m != "sample_len"), None)


def comparison_table(bodies: list[dict]) -> str:
    """One row per artifact plus the base; tasks as extra columns (model / base)."""
    task_cols = []
    for b in bodies:
        for t, v in (b.get("tasks") or {}).items():
            m = _task_metric(v["model"])
            if m and (t, m) not in task_cols:
                task_cols.append((t, m))
    head = ["model", "format", "size MB", "PPL", "Δ PPL %", "KLD mean ± se", "KLD p99", "same top %", "Δp rms %",
            *[f"{t} {m}" for t, m in task_cols], "gen agree %", "gen ROUGE-L"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = next((b for b in bodies if b.get("ppl", {}).get("base") is not None), None)
    if base:
        size = base.get("base_size_bytes")
        cells = [f"base: {Path(base['base']).name}", "float", _f(size and size / 1e6, 1), _f(base["ppl"]["base"]),
                 "0", "0", "0", "100", "0"]
        cells += [_f(base.get("tasks", {}).get(t, {}).get("base", {}).get(m)) for t, m in task_cols]
        lines.append("| " + " | ".join(cells + ["100", "1"]) + " |")
    for b in bodies:
        ppl, kld, gen = b.get("ppl", {}), b.get("kld"), b.get("generation")
        rise = 100 * (ppl["model"] / ppl["base"] - 1) if ppl.get("base") else None
        cells = [_name(b), b["format"], _f(b["size_bytes"] / 1e6, 1), _f(ppl["model"]), _f(rise, 2),
                 f"{kld['mean']:.5f} ± {kld['stderr']:.5f}" if kld else "—", _f(kld and kld["p99"]),
                 _f(b.get("same_top") and 100 * b["same_top"], 2),
                 _f(b.get("delta_p") and 100 * b["delta_p"]["rms"], 3)]
        cells += [_f(b.get("tasks", {}).get(t, {}).get("model", {}).get(m)) for t, m in task_cols]
        cells += [_f(gen and 100 * gen["token_agreement"], 1), _f(gen and gen["rouge_l"], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def domain_table(bodies: list[dict]) -> str:
    """Perplexity and KLD of every artifact on every domain: where quality holds and where it does not."""
    domains = list(dict.fromkeys(d for b in bodies for d in b.get("domains", {})))
    head = ["model", *[f"{d} PPL" for d in domains], *[f"{d} KLD" for d in domains]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = next((b for b in bodies if b.get("ppl", {}).get("base") is not None), None)
    if base:
        cells = [f"base: {Path(base['base']).name}",
                 *[_f(base["domains"].get(d, {}).get("ppl", {}).get("base"), 3) for d in domains], *["0"] * len(domains)]
        lines.append("| " + " | ".join(cells) + " |")
    for b in bodies:
        ds = b.get("domains", {})
        cells = [_name(b), *[_f(ds.get(d, {}).get("ppl", {}).get("model"), 3) for d in domains],
                 *[_f((ds.get(d, {}).get("kld") or {}).get("mean"), 4) for d in domains]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(bodies: list[dict]) -> str:
    first = bodies[0]
    domains = first.get("domains", {})
    counts = ", ".join(f"{d} {m.get('windows')}" for d, m in domains.items())
    parts = ["# quantkit evaluation", "",
             f"Data: {', '.join(domains)}; windows of {first['seq_len']} tokens ({counts}); device {first['device']}; "
             f"base top-k {first.get('top_k', '—')}. The first table is {next(iter(domains))}.",
             "", comparison_table(bodies), ""]
    parts += [f"**Warning** ({_name(b)}): {b['engine']['warning']}.\n" for b in bodies
              if (b.get("engine") or {}).get("warning")]
    if len(domains) > 1:
        parts += ["## Per domain", "", domain_table(bodies), ""]
    for b in bodies:
        tasks = b.get("tasks")
        if tasks:
            s = b["tasks_settings"]
            parts += [f"## Tasks: {_name(b)}", "",
                      f"lm-eval {s['lm_eval']}, limit {s['limit']}, {s['num_fewshot']}-shot, batch {s['batch_size']}, "
                      f"max length {s['max_length']}, BOS added: {_bos(s.get('add_bos_token'))}, chat template: "
                      f"{s['chat_template']}, model type {s.get('model_type', 'hf')}.",
                      "", "| task | metric | model | base | ratio |", "|---|---|---|---|---|"]
            for t, v in tasks.items():
                for m, val in v["model"].items():
                    if m.endswith("_stderr") or m == "sample_len":
                        continue
                    se = v["model"].get(f"{m}_stderr")
                    parts.append(f"| {t} | {m} | {_f(val)}{f' ± {se:.4f}' if isinstance(se, float) else ''} | "
                                 f"{_f(v.get('base', {}).get(m))} | {_f(v.get('ratio', {}).get(m))} |")
            parts.append("")
        gen = b.get("generation")
        if gen:
            parts += [f"## Generations: {_name(b)}", "",
                      f"{gen['prompts']} prompts, greedy, {gen['max_new_tokens']} new tokens, chat template "
                      f"{gen['chat_template']}: token agreement {100 * gen['token_agreement']:.1f} %, identical "
                      f"{100 * gen['identical']:.0f} %, first divergence at token {gen['first_divergence_mean']:.1f} "
                      f"on average, ROUGE-L {gen['rouge_l']:.3f}.", ""]
            for s in gen["samples"]:
                parts += [f"**Prompt:** {s['prompt']}", "", "| base | model |", "|---|---|",
                          f"| {_cell(s['base'])} | {_cell(s['model'])} |", ""]
    return "\n".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def plots(bodies: list[dict], out: Path) -> list[Path]:
    """kld_distribution.png (per-token KLD histogram per artifact, log x), quality_vs_size.png and, with several
    domains, kld_by_domain.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    with_kld = [b for b in bodies if b.get("kld")]
    if with_kld:
        fig, ax = plt.subplots(figsize=(7, 4))
        for b in with_kld:
            h = b["kld"]["histogram"]
            edges, counts = h["edges"], h["counts"]
            total = sum(counts)
            # bin i lies between edges[i-1] and edges[i]; plot the interior bins at their geometric centres
            xs = [(edges[i - 1] * edges[i]) ** 0.5 for i in range(1, len(edges))]
            ax.plot(xs, [c / total for c in counts[1:-1]], marker=".", label=_name(b))
        ax.set_xscale("log")
        ax.set_xlabel("per-token KL divergence vs base (nats)")
        ax.set_ylabel("fraction of tokens")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(out / "kld_distribution.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    domains = list(dict.fromkeys(d for b in with_kld for d in b.get("domains", {})))
    if len(domains) > 1:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(domains)), 4))
        width = 0.8 / len(with_kld)
        for i, b in enumerate(with_kld):
            ys = [(b["domains"].get(d, {}).get("kld") or {}).get("mean", float("nan")) for d in domains]
            ax.bar([j + i * width for j in range(len(domains))], ys, width, label=_name(b))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(domains))], domains)
        ax.set_ylabel("mean KLD vs base (nats)")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        written.append(out / "kld_by_domain.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for b in bodies:
        mb = b["size_bytes"] / 1e6
        a1.scatter(mb, b["ppl"]["model"])
        a1.annotate(_name(b), (mb, b["ppl"]["model"]), fontsize=8)
        if b.get("kld"):
            a2.scatter(mb, b["kld"]["mean"])
            a2.annotate(_name(b), (mb, b["kld"]["mean"]), fontsize=8)
    base = next((b for b in bodies if b.get("ppl", {}).get("base") is not None), None)
    if base:
        a1.axhline(base["ppl"]["base"], ls="--", color="grey", label="base")
        if base.get("base_size_bytes"):
            a1.scatter(base["base_size_bytes"] / 1e6, base["ppl"]["base"], marker="*", s=120, color="grey")
        a1.legend()
    a1.set_xlabel("weight bytes (MB)")
    a1.set_ylabel("perplexity")
    a2.set_xlabel("weight bytes (MB)")
    a2.set_ylabel("mean KLD vs base (nats)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    written.append(out / "quality_vs_size.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def _bos(added: bool | None) -> str:
    return "the tokenizer's default" if added is None else str(added)
