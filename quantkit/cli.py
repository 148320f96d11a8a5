"""quantkit command line: `quantkit quantize RECIPE`, `quantkit eval MODEL`, `quantkit report A B ...`,
`quantkit bench ARTIFACT`, `quantkit search RECIPE`, `quantkit verify ARTIFACT`, `quantkit sign ARTIFACT`, `quantkit release RECIPE`,
`quantkit gate REPORT`."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import click

from .cli_eval import eval_cmd, report
from .errors import QuantkitError, first_line
from .files import write_json
from .progress import Reporter
from .versions import package_versions


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        """The last resort: an error no check turned into a QuantkitError is still one line (its traceback with
        --debug or QUANTKIT_DEBUG=1)."""
        try:
            return super().invoke(ctx)
        except (QuantkitError, click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:
            if ctx.params.get("debug") or os.environ.get("QUANTKIT_DEBUG") == "1":
                traceback.print_exc()
            raise QuantkitError(f"{type(err).__name__}: {first_line(err)} (an unexpected error; --debug shows "
                                "where)") from None


@click.group(cls=_Group)
@click.version_option(package_name="quantkit")
@click.option("--debug", is_flag=True, help="Print the traceback of an unexpected error.")
def cli(debug: bool) -> None:
    """Quantize causal LMs and measure what it cost."""


cli.add_command(eval_cmd, "eval")
cli.add_command(report)


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@click.option("--overwrite", is_flag=True, help="Replace existing artifact folders.")
@click.option("--no-resume", is_flag=True, help="Start over even when a killed run of this recipe left checkpoints.")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
@click.option("--json", "json_out", metavar="FILE", help="Write a machine-readable summary here.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes sharing the calibration: launches the same command under torchrun.")
def quantize(recipe_path: str, overwrite: bool, no_resume: bool, quiet: bool, json_out: str | None,
             nproc: int) -> None:
    """Quantize the model a YAML recipe names and write its artifacts. A run killed mid-way resumes from its
    last finished block when started again with the same recipe."""
    # read by torch once, at its first allocation (so before it is imported): tensors of 2 MB and more get transparent
    # huge pages where the kernel grants them on request. A run maps and unmaps every block-sized temporary
    # (quantize/source.py); each then faults once per 2 MB instead of once per 4 KB page
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from .quantize.run import run_quantize
    from .recipe import load_recipe

    recipe = load_recipe(recipe_path)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        from .quantize.distributed import launch

        args = [recipe_path] + ["--overwrite"] * overwrite + ["--no-resume"] * no_resume + ["--quiet"] * quiet
        args += ["--json", json_out] if json_out else []
        sys.exit(launch(nproc, args, Path(recipe.export.output)))
    summary = run_quantize(recipe, overwrite, Reporter(quiet), resume=not no_resume)
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(json_out, summary)


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@click.option("--overwrite", is_flag=True, help="Replace the existing artifact folders with the chosen mix's.")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
@click.option("--json", "json_out", metavar="FILE", help="Write search.json here too.")
def search(recipe_path: str, overwrite: bool, quiet: bool, json_out: str | None) -> None:
    """Choose a per-layer mix of the recipe's `search.candidates` within `search.budget` for the lowest KLD on the
    worst domain, quantize it, and measure it: EXPORT/search/recipe.yaml, search.json, pareto.png, layers.md and
    the artifact. The sensitivity pass resumes where a killed search stopped."""
    from .search.run import run_search

    write_json(json_out, run_search(recipe_path, Reporter(quiet), overwrite))


def _size(text: str, option: str) -> int:
    from pydantic_core import PydanticCustomError

    from .recipe import parse_size

    try:
        return parse_size(text)
    except PydanticCustomError:
        raise QuantkitError(f"{option}: {text!r} is not a size like 1GiB or 500MB") from None


def _batches(ctx, param, value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(b) for b in value.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise click.BadParameter(f"expected positive integers separated by commas, got '{value}'")
    return out


@cli.command()
@click.argument("artifacts", nargs=-1, required=True, metavar="ARTIFACT...")
@click.option("--baseline", metavar="ORIGINAL", help="The original model, benched in the same run for ratios.")
@click.option("--batch", "batches", default="1,8,32", show_default=True, callback=_batches, help="Batch sizes.")
@click.option("--prompt-len", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--gen-len", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]), show_default=True)
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Compute dtype of the artifact (auto: bfloat16 on CUDA, float32 on CPU).")
@click.option("--baseline-dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Dtype of the original (auto: bfloat16 on CUDA, float32 on CPU).")
@click.option("--reps", default=3, show_default=True, type=click.IntRange(min=1), help="Timed repetitions.")
@click.option("--int4-kernel", "int4_backend", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "quantkit"]),
              help="W4A16 kernel: torch = PyTorch's int4 (tinygemm) kernels; quantkit = quantkit's AVX2 CPU kernel; "
                   "auto = quantkit's on x86 CPUs where it builds, else torch's.")
@click.option("--kv-budget", default="1GiB", show_default=True,
              help="KV-cache memory the capacity figure fills with sequences of --prompt-len + --gen-len tokens.")
@click.option("--compile", "compile_", is_flag=True,
              help="Also run each model with a static KV cache and torch.compile (CUDA graphs on GPU), side by side.")
@click.option("--engine", default="quantkit", show_default=True, type=click.Choice(["quantkit", "vllm"]),
              help="vllm: serve every model in vLLM (its own venv); --batch is then the number of concurrent "
                   "requests, and TTFT / inter-token latency / throughput / KV-cache capacity are measured.")
@click.option("--vllm-python", metavar="PYTHON", help="vLLM's interpreter (default $QUANTKIT_VLLM_PYTHON).")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
@click.option("--json", "json_out", metavar="FILE", help="Write the results (stable keys) here.")
@click.option("--markdown", "md_out", metavar="FILE", help="Write the markdown tables here.")
def bench(artifacts, baseline, batches, prompt_len, gen_len, device, dtype, baseline_dtype, reps, int4_backend,
          kv_budget, compile_, engine, vllm_python, quiet, json_out, md_out) -> None:
    """Memory and tokens/s of each ARTIFACT on the device with real low-bit kernels (and of the original with
    --baseline, once), a roofline of each decode run; results also go into each artifact's quantkit.json."""
    from .bench import runner, serving
    from .model import load_config, resolve_model_path
    from .untrusted import check_positions

    for artifact in artifacts:
        if not Path(artifact).exists():
            raise QuantkitError(f"ARTIFACT: not found: {artifact}")
    if baseline:  # checked before minutes of benching, not when its turn comes last
        resolve_model_path(baseline, "--baseline")
    for model in [*artifacts, *([baseline] if baseline else [])]:
        check_positions(load_config(model)[0], prompt_len + gen_len, "--prompt-len + --gen-len", model)
    rep = Reporter(quiet)
    if engine == "vllm":
        o = serving.ServingOptions(baseline=baseline, concurrency=batches, prompt_len=prompt_len, gen_len=gen_len,
                                   reps=reps, vllm_python=vllm_python)
        body = serving.run_serving_bench(list(artifacts), o, rep)
        markdown = serving.markdown
    else:
        o = runner.BenchOptions(baseline=baseline, batches=batches, prompt_len=prompt_len, gen_len=gen_len,
                                device=device, dtype=dtype, baseline_dtype=baseline_dtype, reps=reps,
                                compile=compile_, int4_backend=int4_backend,
                                kv_budget=_size(kv_budget, "--kv-budget"))
        body = runner.run_bench(list(artifacts), o, rep)
        markdown = runner.markdown
    body["versions"] = package_versions()
    table = markdown(body)
    click.echo(table)
    write_json(json_out, body)  # the measurements first: a manifest that cannot be updated must not lose them
    if md_out:
        Path(md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(md_out).write_text(table + "\n")
    for artifact in artifacts:
        try:
            manifest = runner.record_in_manifest(artifact, body, "bench_vllm" if engine == "vllm" else "bench")
        except (OSError, ValueError) as err:
            rep.warn(f"{artifact}: results not recorded in its quantkit.json ({err})")
            continue
        if manifest:
            rep.info(f"recorded in {manifest}")


@cli.command("verify")
@click.argument("artifact", metavar="ARTIFACT")
@click.option("--signature", metavar="SIG", help="The model-signing signature (default ARTIFACT/model.sig).")
@click.option("--public-key", metavar="PEM", help="Check the signature with this EC public key (required then).")
@click.option("--certificate-chain", multiple=True, metavar="PEM",
              help="Check a certificate signature against these trusted certificates (repeatable).")
@click.option("--json", "json_out", metavar="FILE", help="Write {artifact, ok, checks: [{name, ok, detail}]} here.")
@click.option("--quiet", is_flag=True, help="Print only the final line (and warnings).")
def verify_cmd(artifact: str, signature: str | None, public_key: str | None, certificate_chain: tuple[str, ...],
               json_out: str | None, quiet: bool) -> None:
    """Check an artifact folder: its signature (with --public-key / --certificate-chain), each file against its
    sha256 in quantkit.json, no code, the safetensors readable, packed tensors as the format stores them, shapes
    and dtypes against config.json, a short forward with finite logits. Exit code 1 when a check fails."""
    from .verify import verify

    result = verify(artifact, signature=signature, public_key=public_key, certificate_chain=certificate_chain)
    if not quiet:
        for line in result.table():
            click.echo(line)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(result.summary())
    write_json(json_out, result.as_json())
    if not result.ok:
        sys.exit(1)  # 2 stays the usage-error code (QuantkitError, from main)


@cli.command()
@click.argument("artifact", metavar="ARTIFACT")
@click.option("--key", required=True, metavar="PEM", help="Elliptic-curve private key (unencrypted PEM).")
@click.option("--signature", metavar="SIG", help="Where to write the signature (default ARTIFACT/model.sig).")
@click.option("--certificate", metavar="PEM", help="The key's signing certificate: sign in certificate mode.")
@click.option("--certificate-chain", multiple=True, metavar="PEM",
              help="The issuer's certificates up to the root (repeatable; with --certificate).")
def sign(artifact: str, key: str, signature: str | None, certificate: str | None,
         certificate_chain: tuple[str, ...]) -> None:
    """Sign an artifact folder that passes `quantkit verify` with OpenSSF model-signing (a Sigstore bundle over
    every file), offline: with a private key, or a certificate. Keyless Sigstore signing needs the network and is
    not offered."""
    from .verify import sign_verified

    if bool(certificate_chain) != bool(certificate):  # model-signing 1.1 fails on a certificate with no chain
        raise QuantkitError("--certificate, --certificate-chain: certificate signing takes both (the chain holds at "
                            "least the issuer's certificate)")
    out = sign_verified(Path(artifact), key, signature, certificate, certificate_chain)
    click.echo(f"sign: {artifact} signed ({'certificate' if certificate else 'key'}); signature {out}")


@cli.command()
@click.argument("recipe_path", metavar="RECIPE")
@click.option("--quiet", is_flag=True, help="Only warnings, errors and the gate table.")
@click.option("--json", "json_out", metavar="FILE", help="Also write the release report here.")
@click.option("--overwrite", is_flag=True, help="Replace artifact folders that another recipe wrote (folders "
              "from an earlier release of this output are replaced anyway).")
def release(recipe_path: str, quiet: bool, json_out: str | None, overwrite: bool) -> None:
    """Quantize -> eval against the original -> bench -> gates -> model card, from one recipe. Steps whose
    inputs are unchanged are skipped, so a re-run resumes. Exit 1 when a gate fails."""
    from . import gates
    from .recipe import load_recipe
    from .release import Release

    recipe = load_recipe(recipe_path)
    body = Release(recipe, recipe_path, Reporter(quiet), overwrite).run()
    write_json(json_out, body)
    results = [gates.GateResult(**r) for r in body["gates"]["results"]]
    click.echo(gates.table(results) if results else "no gates declared")
    state = Path(recipe.export.output) / "release" / "report.json"
    click.echo(f"release: {body['artifact']} {'passed' if body['gates']['passed'] else 'FAILED'} "
               f"({', '.join(f'{k} {v}' for k, v in body['steps'].items())}); report {state}")
    if not body["gates"]["passed"]:
        sys.exit(1)


@cli.command()
@click.argument("report_path", metavar="REPORT.json")
@click.option("--recipe", "recipe_path", metavar="RECIPE", help="Check the gates of this recipe instead of the ones "
              "recorded in the report.")
@click.option("--json", "json_out", metavar="FILE", help="Write {passed, results} here.")
def gate(report_path: str, recipe_path: str | None, json_out: str | None) -> None:
    """Check release gates against a release report (EXPORT_OUTPUT/release/report.json): a table of measured vs
    required; exit 1 when any gate fails."""
    from . import gates
    from pydantic import ValidationError

    from .recipe import Gates, format_validation_error, load_recipe

    try:
        body = json.loads(Path(report_path).read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, not UTF-8
        raise QuantkitError(f"{report_path}: not a readable release report ({err})") from None
    if not isinstance(body, dict) or "eval" not in body or "gates" not in body:
        raise QuantkitError(f"{report_path}: not a quantkit release report (no 'eval' / 'gates')")
    declared = load_recipe(recipe_path).gates if recipe_path else None
    try:
        if declared is None:
            declared = Gates.model_validate((body["gates"] or {}).get("declared"))
        results = gates.evaluate(declared, body["eval"], body.get("bench"), body.get("artifact"))
    except ValidationError as err:
        raise QuantkitError(format_validation_error(err, f"{report_path}: gates.declared")) from None
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise QuantkitError(f"{report_path}: malformed release report ({type(err).__name__}: {err})") from None
    click.echo(gates.table(results) if results else "no gates declared")
    summary = gates.summary(results)
    write_json(json_out, summary)
    click.echo(f"gates: {'passed' if summary['passed'] else 'FAILED'} "
               f"({sum(r.passed for r in results)}/{len(results)})")
    if not summary["passed"]:
        sys.exit(1)


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
