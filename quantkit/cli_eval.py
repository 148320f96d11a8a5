"""`quantkit eval MODEL` and `quantkit report A B ...`: the evaluation commands (cli.py registers them)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import QuantkitError
from .files import write_json
from .progress import Reporter
from .versions import package_versions


def eval_options(fn):
    """Options shared by `eval` and `report` (one evaluation per model, same settings for all)."""
    opts = [
        click.option("--base", metavar="ORIGINAL", help="The original model: adds KLD / top-token / Δp, task ratios "
                     "and generation agreement. Its results are cached on disk."),
        click.option("--dataset", "datasets", multiple=True, default=["wikitext2"], show_default=True,
                     help="Repeatable. A bundled domain's test split (wikitext2, fiction, code, chat, math), self "
                     "(text the base writes), suite (all of them) or a .txt/.raw/.jsonl/.parquet file."),
        click.option("--self-tokens", default=8192, show_default=True, type=click.IntRange(min=2),
                     help="Tokens of the self domain (sampled from the base once, then cached)."),
        click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(min=2)),
        click.option("--max-tokens", type=click.IntRange(min=2), help="Evaluate only the first N tokens."),
        click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"])),
        click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"])),
        click.option("--tasks", help="lm-eval tasks, comma separated (bundled offline: wikitext, lambada_openai, "
                     "arc_easy; other names go to lm-eval's registry)."),
        click.option("--limit", type=click.IntRange(min=1), help="lm-eval: first N examples per task."),
        click.option("--num-fewshot", type=click.IntRange(min=0), help="lm-eval: few-shot examples (default 0)."),
        click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1),
                     help="lm-eval and generation batch size."),
        click.option("--kld-top-k", "top_k", default=256, show_default=True, type=click.IntRange(min=1),
                     help="Base log-probs kept per token (the KLD is exact when this covers the vocabulary)."),
        click.option("--generation/--no-generation", default=True, show_default=True,
                     help="Greedy generations of model and base compared (needs --base)."),
        click.option("--gen-prompts", metavar="FILE", help="JSONL of {\"prompt\": ...} (default: bundled 16 prompts)."),
        click.option("--gen-tokens", default=64, show_default=True, type=click.IntRange(min=1)),
        click.option("--cache-dir", metavar="DIR", help="Base cache (default $QUANTKIT_CACHE or ~/.cache/quantkit)."),
        click.option("--base-load", default="auto", show_default=True, type=click.Choice(["auto", "memory", "stream"]),
                     help="stream: the base's log-probs block by block from its safetensors, for a base larger than "
                     "memory; auto: stream when its files take over half the free memory and no task or generation "
                     "needs it whole."),
        click.option("--engine", default="quantkit", show_default=True, type=click.Choice(["quantkit", "vllm"]),
                     help="What runs the model: quantkit's runtime, or vLLM in its own environment (perplexity, KLD "
                     "and generations; the base always runs in quantkit, from its cache)."),
        click.option("--vllm-python", metavar="PYTHON", help="vLLM's interpreter (default $QUANTKIT_VLLM_PYTHON; "
                     "`make vllm-env` builds one)."),
        click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _options(kw: dict):
    from .evaluation.runner import EvalOptions
    from .evaluation.tasks import parse_tasks

    return EvalOptions(base=kw["base"], datasets=list(kw["datasets"]), self_tokens=kw["self_tokens"], seq_len=kw["seq_len"], max_tokens=kw["max_tokens"],
                       dtype=kw["dtype"], device=kw["device"], tasks=parse_tasks(kw["tasks"]), limit=kw["limit"],
                       num_fewshot=kw["num_fewshot"], batch_size=kw["batch_size"], top_k=kw["top_k"],
                       generation=kw["generation"], gen_prompts=kw["gen_prompts"], gen_tokens=kw["gen_tokens"],
                       cache_dir=kw["cache_dir"], base_load=kw["base_load"], engine=kw["engine"],
                       vllm_python=kw["vllm_python"])


def _summary_line(body: dict) -> str:
    parts = []
    for d, m in body["domains"].items():
        line = f"{d} perplexity {m['ppl']['model']:.4f}"
        if m.get("kld"):
            line += (f" (base {m['ppl']['base']:.4f}), KLD {m['kld']['mean']:.5f} ± {m['kld']['stderr']:.5f}, "
                     f"p99 {m['kld']['p99']:.4f}, same top {100 * m['same_top']:.2f} %")
        parts.append(line)
    for t, v in (body.get("tasks") or {}).items():
        for m in ("acc", "word_perplexity"):
            if m in v["model"]:
                base = v.get("base", {}).get(m)
                parts.append(f"{t} {m} {v['model'][m]:.4f}" + (f" (base {base:.4f})" if base is not None else ""))
    if body.get("generation"):
        parts.append(f"generation agreement {100 * body['generation']['token_agreement']:.1f} %")
    return f"{body['model']}: " + "; ".join(parts)


@click.command("eval")
@click.argument("model_path", metavar="MODEL")
@eval_options
@click.option("--json", "json_out", metavar="FILE", help="Write the results (stable keys) here.")
@click.option("--markdown", "md_out", metavar="FILE", help="Write a markdown report here.")
def eval_cmd(model_path, json_out, md_out, **kw) -> None:
    """Perplexity of a model or artifact; with --base, its distribution shift, task scores and generations
    side by side with the original's."""
    from .evaluation.report import markdown
    from .evaluation.runner import evaluate

    o = _options(kw)
    if o.generation and not o.base and kw["gen_prompts"]:
        raise QuantkitError("--gen-prompts: generation agreement needs --base")
    body = evaluate(model_path, o, Reporter(kw["quiet"]))
    body["versions"] = package_versions()
    click.echo(_summary_line(body))
    write_json(json_out, body)
    if md_out:
        Path(md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(md_out).write_text(markdown([body]) + "\n")


@click.command()
@click.argument("items", nargs=-1, required=True, metavar="ARTIFACT_OR_JSON...")
@eval_options
@click.option("--out", "out_dir", required=True, metavar="DIR", help="Folder for report.md, report.json and PNGs.")
def report(items, out_dir, **kw) -> None:
    """Compare several artifacts in one table and plots. Each item is an artifact/model (evaluated here with
    the options given) or a JSON written by `quantkit eval --json`."""
    from .evaluation.report import markdown, plots
    from .evaluation.runner import evaluate

    o = _options(kw)
    rep = Reporter(kw["quiet"])
    bodies = []
    for item in items:
        if item.endswith(".json"):
            try:
                body = json.loads(Path(item).read_text())
            except (OSError, ValueError) as err:  # ValueError: not JSON, not UTF-8
                raise QuantkitError(f"{item}: not a readable quantkit eval JSON ({err})") from None
            if "ppl" not in body or "size_bytes" not in body:
                raise QuantkitError(f"{item}: not a quantkit eval JSON (no 'ppl' / 'size_bytes')")
        else:
            rep.info(f"== {item}")
            body = evaluate(item, o, Reporter(kw["quiet"]))  # timings per item
        bodies.append(body)
        click.echo(_summary_line(body))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(bodies) + "\n")
    write_json(str(out / "report.json"), {"results": bodies, "versions": package_versions()})
    for png in plots(bodies, out):
        rep.info(f"wrote {png}")
    click.echo(f"report: {out / 'report.md'}")
