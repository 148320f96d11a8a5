"""quantkit command line: `quantkit quantize RECIPE`, `quantkit eval MODEL`."""

from __future__ import annotations

import json
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import click

from .errors import QuantkitError
from .progress import Reporter


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("quantkit", "torch", "transformers", "safetensors", "compressed-tensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_json(path: str | None, body: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(body, indent=2) + "\n")


@click.group()
@click.version_option(package_name="quantkit")
def cli() -> None:
    """Quantize causal LMs and measure what it cost."""


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@click.option("--overwrite", is_flag=True, help="Replace existing artifact folders.")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
@click.option("--json", "json_out", metavar="FILE", help="Write a machine-readable summary here.")
def quantize(recipe_path: str, overwrite: bool, quiet: bool, json_out: str | None) -> None:
    """Quantize the model a YAML recipe names and write its artifacts."""
    import torch

    from . import calibration, pipeline
    from .export.artifact import write_artifact
    from .model import load_model, pick_device, torch_dtype
    from .recipe import parse_size, load_recipe

    report = Reporter(quiet)
    start = time.perf_counter()
    recipe = load_recipe(recipe_path)
    out_root = Path(recipe.export.output)
    dests = {fmt: out_root / fmt for fmt in recipe.export.formats}
    for dest in dests.values():
        if dest.exists() and not overwrite:
            raise QuantkitError(f"export.output: {dest} already exists (pass --overwrite to replace it)")
    device = pick_device(recipe.device)
    torch.manual_seed(0)
    with report.timed("load"):
        loaded = load_model(recipe.model, recipe.dtype)
    report.info(f"loaded {recipe.model} ({type(loaded.model).__name__}, {loaded.model.dtype}) "
                f"in {report.timings['load']:.1f} s")
    calib = None
    if recipe.stage.name == "gptq":
        with report.timed("calibration"):
            calib = calibration.build(loaded.tokenizer, recipe.calibration)
        report.info(f"calibration: {tuple(calib.tokens.shape)} tokens from {calib.source} (sha256 {calib.sha256[:12]})")
    with report.timed("quantize"):  # the stage's own phases are timed inside the pipeline
        result = pipeline.quantize(loaded.model, recipe.stage, calib, device, recipe.export.formats, report)
    dtype = torch_dtype(recipe.export.dtype, loaded.model.dtype)
    manifest = {
        "quantkit_version": package_versions()["quantkit"],
        "recipe": recipe.model_dump(mode="json"),
        "versions": package_versions(),
        "calibration": None if calib is None else {
            "source": calib.source, "sha256": calib.sha256,
            "num_samples": int(calib.tokens.shape[0]), "seq_len": int(calib.tokens.shape[1]),
        },
        "timings_s": dict(report.timings),
        "losses": result.losses,
    }
    for fmt, dest in dests.items():
        with report.timed(f"export:{fmt}"):
            write_artifact(dest, fmt, loaded.model, loaded.tokenizer, result.qweights, result.info, dtype,
                           parse_size(recipe.export.max_shard_size), manifest, overwrite)
        report.info(f"wrote {dest} in {report.timings[f'export:{fmt}']:.1f} s")
    total = time.perf_counter() - start
    report.info("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.timings.items()) + f"; total {total:.1f} s")
    write_json(json_out, {
        "outputs": {fmt: str(d) for fmt, d in dests.items()},
        "timings_s": dict(report.timings) | {"total": round(total, 3)},
        "quantized_modules": len(result.qweights),
        "loss_total": sum(v for v in result.losses.values() if v == v),
        "calibration_sha256": None if calib is None else calib.sha256,
    })


@cli.command("eval")
@click.argument("model_path", metavar="MODEL")
@click.option("--dataset", default="wikitext2", show_default=True, help="wikitext2 (bundled test split) or a text file.")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(min=2))
@click.option("--max-tokens", type=click.IntRange(min=2), help="Evaluate only the first N tokens.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--quiet", is_flag=True)
@click.option("--json", "json_out", metavar="FILE")
def eval_cmd(model_path, dataset, seq_len, max_tokens, dtype, device, quiet, json_out) -> None:
    """Token perplexity of a model or artifact (GPTQ-style non-overlapping windows)."""
    from . import runtime
    from .eval.perplexity import eval_tokens, perplexity
    from .model import pick_device

    report = Reporter(quiet)
    dev = pick_device(device)
    with report.timed("load"):
        loaded = runtime.load(model_path, dtype)
    loaded.model.to(dev)
    ids = eval_tokens(loaded.tokenizer, dataset, max_tokens)
    result = perplexity(loaded.model, ids, seq_len, report, dev)
    bos = loaded.tokenizer.bos_token_id is not None and int(ids[0]) == loaded.tokenizer.bos_token_id
    body = {"model": model_path, "dataset": dataset, "format": runtime.artifact_format(model_path) or "float",
            "bos_prepended": bos, **result, "ppl": round(result["ppl"], 4)}
    click.echo(f"{model_path}: {dataset} perplexity {result['ppl']:.4f} "
               f"({result['windows']} windows x {seq_len} tokens, {result['seconds']:.0f} s)")
    write_json(json_out, body)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except QuantkitError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
