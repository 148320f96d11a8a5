"""`quantkit release RECIPE`: quantize -> eval against the original -> bench -> gates -> model card.

Each step records, in EXPORT_OUTPUT/release/STEP.json, a key hashing its inputs (the recipe's sections it reads,
the original's files, the artifact's file hashes, package versions) next to its result; a step whose key still
matches and whose outputs are intact is skipped, so re-running after a failure resumes where it stopped (and the
quantize step itself resumes inside the model from its per-block checkpoints).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from . import gates as gate_checks
from . import signing
from .bench.runner import device_name
from .data import SELF, expand, resolve
from .errors import QuantkitError
from .export.artifact import MANIFEST_NAME, sha256_file
from .files import write_json_atomic
from .model import model_fingerprint, pick_device
from .progress import Reporter
from .quantize.calibration import parts_of
from .quantize.resume import run_key
from .quantize.run import recipe_fingerprint, run_quantize
from .recipe import Recipe
from .verify import sign_verified
from .versions import package_versions

CARD = "README.md"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def data_fingerprint(dataset: str, purpose: str, field: str) -> dict:
    """Identity of a text source: its resolved file, size and content hash (an edited file invalidates)."""
    path = resolve(dataset, purpose, field)
    return {"path": str(path.resolve()), "size": path.stat().st_size, "sha256": sha256_file(path)}


def artifact_files(folder: Path) -> dict[str, str] | None:
    """The artifact's recorded file hashes (the card excluded), or None when any file is missing or differs."""
    manifest = _read(folder / MANIFEST_NAME)
    if manifest is None:
        return None
    files = {k: v for k, v in manifest.get("files", {}).items() if k != CARD}
    for name, digest in files.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            return None
    return files


class Release:
    def __init__(self, recipe: Recipe, recipe_path: str, report: Reporter, overwrite: bool = False):
        self.recipe, self.recipe_path, self.report, self.overwrite = recipe, recipe_path, report, overwrite
        self.root = Path(recipe.export.output)
        self.state = self.root / "release"
        fmt = recipe.release.format or recipe.export.formats[0]
        self.artifact = self.root / fmt
        self.versions = package_versions()
        self.steps: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    def _step(self, name: str, key: str, complete, run) -> dict:
        """Runs `run()` unless STEP.json holds this key and `complete(result)` holds."""
        path = self.state / f"{name}.json"
        saved = _read(path)
        if saved is not None and saved.get("key") == key and complete(saved["result"]):
            self.steps[name] = "skipped (inputs unchanged)"
            self.report.info(f"release: {name}: up to date, skipped")
            return saved["result"]
        self.report.info(f"release: {name}")
        start = time.perf_counter()
        result = run()
        self.timings[name] = round(time.perf_counter() - start, 3)
        self.state.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"key": key, "result": result})
        self.steps[name] = "ran"
        return result

    def quantize(self) -> dict:
        cal = self.recipe.calibration
        data = [data_fingerprint(p.dataset, "calibration", "calibration.dataset") if p.dataset != "self" else "self"
                for p in parts_of(cal)] if cal else None
        key = run_key({"recipe": recipe_fingerprint(self.recipe), "export": self.recipe.export.model_dump(mode="json"),
                       "model": model_fingerprint(self.recipe.model), "calibration": data,
                       "versions": self.versions})
        folders = [self.root / f for f in self.recipe.export.formats]

        def complete(result: dict) -> bool:
            return all(artifact_files(f) == result["files"].get(f.name) for f in folders)

        def run() -> dict:
            # an earlier release of this output may be replaced; another tool's or recipe's folder only on request
            overwrite = self.overwrite or (self.state / "quantize.json").is_file()
            summary = run_quantize(self.recipe, overwrite=overwrite, report=self.report)
            return summary | {"files": {f.name: artifact_files(f) for f in folders}}

        return self._step("quantize", key, complete, run)

    def _artifact_key(self, settings: dict, device: str, data: dict | None = None) -> str:
        """Hashes the artifact's files, the step's settings, the machine it runs on and the data it reads."""
        files = artifact_files(self.artifact)
        if files is None:
            raise QuantkitError(f"{self.artifact}: artifact files changed or missing after quantize")
        return run_key({"artifact": files, "settings": settings, "base": model_fingerprint(self.recipe.model),
                        "device": device_name(pick_device(device)), "data": data, "versions": self.versions})

    def evaluate(self) -> dict:
        from .evaluation.runner import EvalOptions, evaluate

        e = self.recipe.release.eval
        o = EvalOptions(base=self.recipe.model, datasets=list(e.datasets), self_tokens=e.self_tokens,
                        seq_len=e.seq_len, max_tokens=e.max_tokens,
                        device=e.device, tasks=list(e.tasks), limit=e.limit, generation=e.generation, engine=e.engine)
        data = [d if d == SELF else data_fingerprint(d, "eval", "release.eval.datasets") for d in expand(o.datasets)]
        key = self._artifact_key(asdict(o), e.device, data)
        return self._step("eval", key, lambda r: True, lambda: evaluate(str(self.artifact), o, self.report))

    def bench(self) -> dict | None:
        from .bench.runner import BenchOptions, record_in_manifest, run_bench

        b = self.recipe.release.bench
        if not b.enabled:
            self.steps["bench"] = "disabled (release.bench.enabled: false)"
            return None
        if b.engine == "vllm":
            return self._bench_in_vllm(b)
        o = BenchOptions(baseline=self.recipe.model, batches=tuple(b.batches), prompt_len=b.prompt_len,
                         gen_len=b.gen_len, device=b.device, reps=b.reps)
        key = self._artifact_key(asdict(o), b.device)

        def run() -> dict:
            body = run_bench([str(self.artifact)], o, self.report)
            record_in_manifest(str(self.artifact), body)
            return body

        return self._step("bench", key, lambda r: True, run)

    def _bench_in_vllm(self, b) -> dict:
        from .bench.runner import record_in_manifest
        from .bench.serving import ServingOptions, run_serving_bench

        # vLLM serves folders: an original given as a GGUF file or a hub id is benched without ratios
        base = self.recipe.model if (Path(self.recipe.model) / "config.json").is_file() else None
        o = ServingOptions(baseline=base, concurrency=tuple(b.batches), prompt_len=b.prompt_len, gen_len=b.gen_len,
                           reps=b.reps)
        key = self._artifact_key(asdict(o) | {"engine": "vllm"}, "cpu")

        def run() -> dict:
            body = run_serving_bench([str(self.artifact)], o, self.report)
            record_in_manifest(str(self.artifact), body, "bench_vllm")
            return body

        return self._step("bench", key, lambda r: True, run)

    def _check_vllm_serves(self, field: str) -> None:
        """vLLM's environment exists, and its build has kernels for the recipe's scheme on this machine."""
        from .engines.vllm import NO_FP4, NO_MXFP8, NO_W4AFP8, NO_WNA16, ONLY_4BIT, VllmEngine, interpreter

        python = interpreter(None, f"{field}: vllm")
        args = self.recipe.stage.weights  # awq alone: its grid, as a WeightQuant
        if args.type == "fp4":
            raise QuantkitError(f"{field}: vllm: {NO_FP4}")
        w4afp8 = args.type == "int" and args.activations is not None and args.activations.type == "float"
        if w4afp8 or args.type == "mxfp8":
            with VllmEngine(python) as engine:
                if engine.kernels()["device"] == "cpu":
                    raise QuantkitError(f"{field}: vllm: {NO_W4AFP8 if w4afp8 else NO_MXFP8}")
        if args.type == "int" and args.activations is None:
            not4 = {args.bits, *(o.bits for o in self.recipe.overrides if o.bits is not None)} - {4}
            with VllmEngine(python) as engine:
                if not4 and engine.kernels()["device"] == "cpu":
                    raise QuantkitError(f"{field}: vllm: {ONLY_4BIT}")
                if not engine.has_wna16():
                    raise QuantkitError(f"{field}: vllm: {NO_WNA16}")
        static = args.activations is not None and not args.activations.dynamic
        layout = "block" if args.block else "static" if static else None
        if layout:
            with VllmEngine(python) as engine:
                refused = engine.fp8_refusal(layout)
                if refused:
                    raise QuantkitError(f"{field}: vllm: {refused}")

    def sign(self) -> list[str]:
        """Last: a signature covers the card too. Unsigned, a signature left by an earlier release no longer
        matches the rewritten card."""
        folders = [self.root / fmt for fmt in self.recipe.export.formats]
        key = self.recipe.release.sign_key
        if key is None:
            for stale in (f / signing.SIGNATURE_NAME for f in folders):
                if stale.is_file():
                    self.report.warn(f"{stale}: left by an earlier signed release; it may no longer match the "
                                     "rewritten card (set release.sign_key, or remove it)")
            return []
        self.report.info(f"release: sign ({len(folders)} folders)")
        return [str(sign_verified(f, key)) for f in folders]

    def run(self) -> dict:
        start = time.perf_counter()
        r = self.recipe.release
        in_vllm = [field for field, engine in (("release.eval.engine", r.eval.engine),
                                               ("release.bench.engine", r.bench.engine if r.bench.enabled else None))
                   if engine == "vllm"]
        if in_vllm:  # before minutes of quantizing
            self._check_vllm_serves(in_vllm[0])
        if r.sign_key:
            signing.check_key(r.sign_key, "release.sign_key")
        quantized = self.quantize()
        ev = self.evaluate()
        bench = self.bench()
        results = gate_checks.evaluate(self.recipe.gates, ev, bench, str(self.artifact))
        body = {
            "recipe": self.recipe_path,
            "artifact": str(self.artifact),
            "model": self.recipe.model,
            "steps": self.steps,
            "timings_s": self.timings | {"total": round(time.perf_counter() - start, 3)},
            "quantize": quantized,
            "eval": ev,
            "bench": bench,
            "gates": {"declared": self.recipe.gates.model_dump(mode="json")} | gate_checks.summary(results),
            "versions": self.versions,
        }
        from .card import write_cards

        body["cards"] = [str(p) for p in write_cards(self.recipe, self.root, body, results)]
        body["signatures"] = self.sign()
        self.state.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.state / "report.json", body)
        return body
