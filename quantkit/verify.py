"""`quantkit verify ARTIFACT`: is an artifact folder still exactly what `quantkit quantize` wrote, and does it run?

1. every file quantkit.json lists is there with its sha256 (files it does not list are warnings);
2. every safetensors file opens (and the shard index, if any, names each tensor's file);
3. config.json builds the model on the meta device (nothing allocated); each quantized module, decoded by the
   runtime's own decoders, has that model's Linear [out, in]; every float tensor has its parameter's shape and
   config.json's dtype; no tensor is missing or extra;
4. `runtime.load` reads it back and a short forward gives finite logits.
Checks 3 and 4 run only when what they read passed 2 and 3 (a sha256 mismatch stops nothing), so the first
failure is the cause, not an echo of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import QuantkitError, first_line
from .export.artifact import INDEX_NAME, MANIFEST_NAME, sha256_file
from .export.base import split_by_module


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Verification:
    artifact: str
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: int = 0
    tensors: int = 0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def table(self) -> list[str]:
        return [f"{'ok' if c.ok else 'FAIL':4}  {c.name:11}  {c.detail}" for c in self.checks]

    def summary(self) -> str:
        if self.ok:
            return f"verify: {self.artifact} ok ({self.files} files, {self.tensors} tensors)"
        return f"verify: {self.artifact} FAILED: {next(c for c in self.checks if not c.ok).detail}"

    def as_json(self) -> dict:
        return {"artifact": self.artifact, "ok": self.ok, "checks": [asdict(c) for c in self.checks],
                "warnings": self.warnings}


def _more(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def verify(path: str | Path, tokens: int = 8) -> Verification:
    folder = Path(path)
    if not folder.is_dir():
        raise QuantkitError(f"ARTIFACT: not a folder: {path}")
    if not (folder / MANIFEST_NAME).is_file():
        raise QuantkitError(f"ARTIFACT: {path} has no {MANIFEST_NAME} (not written by quantkit quantize)")
    v = Verification(str(path))
    listed = _manifest_files(folder, v)
    if listed is not None:
        _check_files(folder, listed, v)
    tensors = _read_safetensors(folder, v)
    model = _meta_model(folder, v)
    if tensors is not None and model is not None:
        fits = _check_tensors(tensors, *model, v)
        del tensors  # runtime.load reads the files again: never both copies in memory
        if fits:
            _check_forward(folder, tokens, v)
    return v


def _manifest_files(folder: Path, v: Verification) -> dict[str, str] | None:
    try:
        body = json.loads((folder / MANIFEST_NAME).read_text())
        files = body["files"]
        if not isinstance(files, dict) or not all(isinstance(h, str) for h in files.values()):
            raise ValueError("'files' is not a {name: sha256} mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        v.add("manifest", False, f"{MANIFEST_NAME}: unreadable ({first_line(err)})")
        return None
    v.files = len(files)
    v.add("manifest", True, f"{MANIFEST_NAME}: {len(files)} files listed (format {body.get('format')})")
    return files


def _check_files(folder: Path, listed: dict[str, str], v: Verification) -> None:
    for name, want in listed.items():
        p = folder / name
        if not p.is_file():
            v.add("sha256", False, f"{name}: missing")
            continue
        got = sha256_file(p)
        if got == want:
            v.add("sha256", True, f"{name}: sha256 ok")
        else:
            v.add("sha256", False, f"{name}: sha256 mismatch (expected {want[:12]}…, got {got[:12]}…; "
                                   f"{p.stat().st_size} bytes)")
    for p in sorted(folder.iterdir()):
        if p.name not in listed and p.name != MANIFEST_NAME:
            v.warnings.append(f"{p.name}: present but not listed in {MANIFEST_NAME}")


def _read_safetensors(folder: Path, v: Verification) -> dict[str, torch.Tensor] | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        v.add("safetensors", False, f"{folder}: no *.safetensors files")
        return None
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    ok = True
    for f in files:
        try:
            with safe_open(str(f), "pt") as fh:
                part = {k: fh.get_tensor(k) for k in fh.keys()}  # safe_open handles have no __iter__
        except (SafetensorError, OSError) as err:  # truncated or corrupt: safetensors names the broken part
            ok = v.add("safetensors", False, f"{f.name}: unreadable ({first_line(err)})")
            continue
        dup = sorted(set(part) & set(tensors))
        if dup:
            ok = v.add("safetensors", False, f"{f.name}: {dup[0]} also in {where[dup[0]]}")
            continue
        tensors |= part
        where |= dict.fromkeys(part, f.name)
        v.add("safetensors", True, f"{f.name}: {len(part)} tensors")
    if ok and (folder / INDEX_NAME).is_file():
        ok = _check_index(folder / INDEX_NAME, where, v)
    v.tensors = len(tensors)
    return tensors if ok else None


def _check_index(path: Path, where: dict[str, str], v: Verification) -> bool:
    """where: tensor name -> the shard file it was read from."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        wrong = sorted(k for k in set(weight_map) | set(where) if weight_map.get(k) != where.get(k))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return v.add("index", False, f"{path.name}: unreadable ({first_line(err)})")
    if wrong:
        return v.add("index", False, _more([f"{path.name}: {k} is in {where.get(k, 'no file')}, the index says "
                                            f"{weight_map.get(k, 'nothing')}" for k in wrong]))
    return v.add("index", True, f"{path.name}: {len(weight_map)} tensors")


def _meta_model(folder: Path, v: Verification):
    """(model on the meta device, quantization_config, format, float dtype) from config.json, or None."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model import quiet_transformers, torch_dtype
    from .runtime import DECODERS

    quiet_transformers()
    try:
        raw = json.loads((folder / "config.json").read_text())
        qcfg = raw.pop("quantization_config", None) or {}
        fmt = qcfg.get("quant_method")
        if fmt not in DECODERS:
            raise ValueError(f"quantization_config.quant_method is {fmt!r}, not one of {', '.join(DECODERS)}")
        dtype = torch_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        config = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    # any error transformers raises for a bad config (ValueError, KeyError, TypeError, ...) is a finding here
    except Exception as err:
        v.add("config", False, f"config.json: {first_line(err)}")
        return None
    v.add("config", True, f"config.json: {type(model).__name__}, {fmt}, {str(dtype).removeprefix('torch.')}")
    return model, qcfg, fmt, dtype


def _check_tensors(tensors: dict[str, torch.Tensor], model, qcfg: dict, fmt: str, dtype: torch.dtype,
                   v: Verification) -> bool:
    from .runtime import DECODERS

    marker, decode = DECODERS[fmt]
    try:
        modules = split_by_module(tensors, marker(qcfg))
    except QuantkitError as err:
        return v.add("shapes", False, f"config.json: {err}")
    expected: dict[str, torch.Tensor] = {}  # the model's tensors, a tied copy once (as the exporter writes them)
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            expected[name] = t
    shapes, dtypes = [], []
    for prefix, parts in sorted(modules.items()):
        want = expected.pop(f"{prefix}.weight", None)
        if want is None:
            shapes.append(f"{prefix}: quantized, but config.json's model has no such Linear")
            continue
        try:
            got = list(decode(parts, qcfg).shape)
        except Exception as err:  # a decoder indexing missing or mis-shaped parts: report which module
            shapes.append(f"{prefix}: cannot decode ({type(err).__name__}: {first_line(err)})")
            continue
        if got != list(want.shape):
            shapes.append(f"{prefix}: decoded weight is {got}, config.json gives {list(want.shape)}")
    floats = {n: t for n, t in tensors.items() if n.rpartition(".")[0] not in modules or n.endswith(".bias")}
    for name, t in sorted(floats.items()):
        want = expected.pop(name, None)
        if want is None:
            shapes.append(f"{name}: not a tensor of config.json's model")
        elif list(t.shape) != list(want.shape):
            shapes.append(f"{name}: shape {list(t.shape)}, config.json gives {list(want.shape)}")
        if t.is_floating_point() and t.dtype != dtype:
            dtypes.append(f"{name}: {str(t.dtype).removeprefix('torch.')}, config.json dtype is "
                          f"{str(dtype).removeprefix('torch.')}")
    shapes += [f"{name}: missing from the safetensors files" for name in sorted(expected)]
    ok = v.add("shapes", not shapes, _more(shapes) if shapes else
               f"{len(modules)} quantized modules and {len(floats)} float tensors match config.json")
    ok = v.add("dtype", not dtypes, _more(dtypes) if dtypes else
               f"float tensors are {str(dtype).removeprefix('torch.')} as config.json says") and ok
    return ok


def _check_forward(folder: Path, tokens: int, v: Verification) -> None:
    from .runtime import load

    try:
        model = load(str(folder)).model
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    except Exception as err:  # verify reports a failing load or forward as a finding, not a traceback
        v.add("forward", False, f"forward: {type(err).__name__}: {first_line(err)}")
        return
    bad = int((~torch.isfinite(logits)).sum())
    v.add("forward", bad == 0, f"forward: {tokens} tokens, logits finite" if bad == 0 else
          f"forward: {bad} of {logits.numel()} logits not finite on {tokens} tokens")
