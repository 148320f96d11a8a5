"""`quantkit verify ARTIFACT`: is an artifact folder still exactly what `quantkit quantize` wrote, and does it run?

0. with a public key or certificate chain, the model-signing signature covers every file (signing.py); without,
   the artifact is said to be unsigned, or signed and not checked;
1. quantkit.json lists files, each there with its sha256; config.json, every safetensors file and the shard index
   are among them, and the index names only shards that are there (other unlisted files are warnings);
2. no code: no `*.py` (or pickle, compiled module) file and no `auto_map` in any JSON file;
3. every safetensors file opens (and the shard index, if any, names each tensor's file);
4. config.json builds the model on the meta device (nothing allocated); each quantized module's packed tensors
   have the dtypes and shapes its format stores for that model's Linear (export/layout.py), and decoded by the
   runtime's own decoders, its [out, in]; every float tensor has its parameter's shape and config.json's dtype;
   no tensor is missing or extra;
5. `runtime.load` reads it back and a short forward gives finite logits.
A manifest that lives beside the files vouches for nothing an editor cannot re-hash: the signature, and checks
2 and 4, are what catch a re-hashed edit. Checks 4 and 5 run only when what they read passed 3 and 4 (a sha256
mismatch stops nothing), so the first failure is the cause, not an echo of it; 5 never runs on an artifact that
carries code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import signing
from .errors import QuantkitError, first_line
from .export import formats, layout
from .export.artifact import INDEX_NAME, MANIFEST_NAME, WEIGHTS_NAME, sha256_file
from .export.base import split_by_module
from .families import moe
from .kernels import kv_cache
from .untrusted import read_json

# files a loader may execute: Python, compiled modules, pickles (torch.load and friends run code from them)
CODE_SUFFIXES = {".py", ".pyc", ".pyo", ".so", ".pyd", ".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}


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
    signed: str = "unsigned"

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def table(self) -> list[str]:
        return [f"{'ok' if c.ok else 'FAIL':4}  {c.name:11}  {c.detail}" for c in self.checks]

    def first_failure(self) -> str:
        return next(c.detail for c in self.checks if not c.ok)

    def summary(self) -> str:
        if self.ok:
            return f"verify: {self.artifact} ok ({self.files} files, {self.tensors} tensors, {self.signed})"
        return f"verify: {self.artifact} FAILED: {self.first_failure()}"

    def as_json(self) -> dict:
        return {"artifact": self.artifact, "ok": self.ok, "signed": self.signed,
                "checks": [asdict(c) for c in self.checks], "warnings": self.warnings}


def _more(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def sign_verified(folder: Path, key: str | Path, signature: str | Path | None = None,
                  certificate: str | Path | None = None, chain: Sequence[str | Path] = ()) -> Path:
    """Signs an artifact only if it passes verify: a signature vouches for what it covers."""
    signing.check_key(key)
    result = verify(folder)
    if not result.ok:
        raise QuantkitError(f"ARTIFACT: {folder} fails verify, not signed: {result.first_failure()}")
    return signing.sign(folder, key, signature, certificate, chain)


def verify(path: str | Path, tokens: int = 8, signature: str | Path | None = None,
           public_key: str | Path | None = None, certificate_chain: tuple[str, ...] = ()) -> Verification:
    """signature: where the model-signing signature is (default ARTIFACT/model.sig); checked only with a public
    key or a certificate chain, and then required."""
    folder = Path(path)
    if not folder.is_dir():
        raise QuantkitError(f"ARTIFACT: not a folder: {path}")
    if not (folder / MANIFEST_NAME).is_file():
        raise QuantkitError(f"ARTIFACT: {path} has no {MANIFEST_NAME} (not written by quantkit quantize)")
    if public_key and certificate_chain:
        raise QuantkitError("--public-key, --certificate-chain: give one (the signer used a key or a certificate)")
    if signature and not (public_key or certificate_chain):
        raise QuantkitError("--signature: checking it needs --public-key or --certificate-chain")
    v = Verification(str(path))
    sig = signing.signature_path(folder, signature)
    _check_signature(folder, sig, public_key, certificate_chain, v)
    listed = _manifest_files(folder, v)
    if listed is not None:
        _check_files(folder, listed, sig, v)
    no_code = _check_no_code(folder, v)
    tensors = _read_safetensors(folder, v)
    model = _meta_model(folder, v)
    if tensors is not None and model is not None:
        fits = _check_tensors(tensors, *model, v)
        del tensors  # runtime.load reads the files again: never both copies in memory
        if fits and no_code:
            _check_forward(folder, tokens, v)
    return v


def _check_signature(folder: Path, sig: Path, public_key, certificate_chain, v: Verification) -> None:
    if public_key or certificate_chain:
        ok, detail = signing.check(folder, sig, public_key, certificate_chain)
        v.signed = "signature ok" if ok else "signature FAILED"
        v.add("signature", ok, detail)
    elif sig.is_file():
        v.signed = "signature not checked"
        v.add("signature", True, f"{sig.name}: signed, not checked (pass --public-key or --certificate-chain)")
    else:
        v.add("signature", True, "unsigned: nothing vouches for these files but quantkit.json beside them")


def _read(path: Path):
    """A JSON file as untrusted.read_json reads it (a key given twice is refused: which one a loader takes is its
    own choice); the error without the path prefix, as the ValueError the checks below report."""
    try:
        return read_json(path)
    except QuantkitError as err:
        raise ValueError(str(err).removeprefix(f"{path}: ")) from None


def _manifest_files(folder: Path, v: Verification) -> dict[str, str] | None:
    try:
        body = _read(folder / MANIFEST_NAME)
        files = body["files"]
        if not isinstance(files, dict) or not all(isinstance(h, str) for h in files.values()):
            raise ValueError("'files' is not a {name: sha256} mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        v.add("manifest", False, f"{MANIFEST_NAME}: unreadable ({first_line(err)})")
        return None
    if not files:
        v.add("manifest", False, f"{MANIFEST_NAME}: lists no files")
        return None
    outside = sorted(name for name in files if not _plain_name(name))
    if outside:
        v.add("manifest", False, f"{MANIFEST_NAME}: {outside[0]!r} is not a file name inside the artifact")
        return None
    v.files = len(files)
    v.add("manifest", True, f"{MANIFEST_NAME}: {len(files)} files listed (format {body.get('format')})")
    return files


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _check_files(folder: Path, listed: dict[str, str], sig: Path, v: Verification) -> None:
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
    # what loaders read must be listed (an unlisted shard or index changes the model); anything else is a warning
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    for p in sorted(folder.iterdir()):
        if p.is_symlink():  # a link reads whatever it points at, inside the artifact or not
            v.add("manifest", False, f"{p.name}: a symbolic link (an artifact holds plain files)")
    for name in ["config.json", *weights, *([INDEX_NAME] if (folder / INDEX_NAME).is_file() else [])]:
        if name not in listed:
            v.add("manifest", False, f"{name}: present but not listed in {MANIFEST_NAME}")
    for name in _index_shards(folder):
        if not _plain_name(name):
            v.add("manifest", False, f"{INDEX_NAME}: names {name!r}, not a file inside the artifact")
        elif not (folder / name).is_file() or name not in listed:
            v.add("manifest", False, f"{INDEX_NAME}: names {name}, which is "
                                   f"{'not listed in ' + MANIFEST_NAME if (folder / name).is_file() else 'missing'}")
    if len(weights) > 1 and not (folder / INDEX_NAME).is_file():
        v.add("manifest", False, f"{INDEX_NAME}: missing, and loaders read {len(weights)} safetensors files only "
                               "through it")
    elif weights and weights != [WEIGHTS_NAME] and not (folder / INDEX_NAME).is_file():
        v.add("manifest", False, f"{weights[0]}: loaders read {WEIGHTS_NAME} when there is no {INDEX_NAME}")
    for p in sorted(folder.iterdir()):
        if p.name not in listed and p.name not in (MANIFEST_NAME, sig.name) and p.name not in weights \
                and p.suffix not in CODE_SUFFIXES:
            v.warnings.append(f"{p.name}: present but not listed in {MANIFEST_NAME}")


def _index_shards(folder: Path) -> list[str]:
    """The files the shard index names ([] without an index; a malformed one is check 3's finding)."""
    try:
        weight_map = _read(folder / INDEX_NAME)["weight_map"]
        return sorted({str(f) for f in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _check_no_code(folder: Path, v: Verification) -> bool:
    """No file a loader could execute, and no `auto_map` (transformers' pointer at remote code) in any JSON."""
    found = [f"{p.relative_to(folder)}: executable code ({p.suffix} file)"
             for p in sorted(folder.rglob("*"))
             if p.suffix in CODE_SUFFIXES and ".git" not in p.relative_to(folder).parts]
    for p in sorted(folder.glob("*.json")):
        try:
            body = _read(p)
        except (OSError, ValueError):
            continue  # config.json's own check, or a file that is no loader's
        if isinstance(body, dict) and "auto_map" in body:
            found.append(f"{p.name}: auto_map points loaders at code")
    return v.add("code", not found, "; ".join(found) if found else "no code files, no auto_map")


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
        weight_map = _read(path)["weight_map"]
        wrong = sorted(k for k in set(weight_map) | set(where) if weight_map.get(k) != where.get(k))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return v.add("index", False, f"{path.name}: unreadable ({first_line(err)})")
    if wrong:
        return v.add("index", False, _more([f"{path.name}: {k} is in {where.get(k, 'no file')}, the index says "
                                            f"{weight_map.get(k, 'nothing')}" for k in wrong]))
    return v.add("index", True, f"{path.name}: {len(weight_map)} tensors")


def _meta_model(folder: Path, v: Verification):
    """(model on the meta device with per-expert Linears, its checkpoint names, quantization_config, format, float
    dtype) from config.json, or None."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model import quiet_transformers, torch_dtype

    quiet_transformers()
    try:
        raw = _read(folder / "config.json")
        qcfg = raw.pop("quantization_config", None) or {}
        fmt = qcfg.get("quant_method")
        if formats.find(fmt) is None:
            raise ValueError(f"quantization_config.quant_method is {fmt!r}, not one of {', '.join(formats.names())}")
        dtype = torch_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        config = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        # per-expert Linears, as quantized; the artifact keeps the original checkpoint's names for them
        names = moe.prepare(model).inverse()
    # any error transformers raises for a bad config (ValueError, KeyError, TypeError, ...) is a finding here
    except Exception as err:
        v.add("config", False, f"config.json: {first_line(err)}")
        return None
    v.add("config", True, f"config.json: {type(model).__name__}, {fmt}, {str(dtype).removeprefix('torch.')}")
    return model, names, qcfg, fmt, dtype


def _check_tensors(tensors: dict[str, torch.Tensor], model, names: moe.CheckpointNames, qcfg: dict, fmt: str,
                   dtype: torch.dtype, v: Verification) -> bool:
    codec = formats.get(fmt)
    tensors = {names(k): t for k, t in tensors.items()}
    try:
        modules = split_by_module(tensors, codec.marker(qcfg))
    except QuantkitError as err:
        return v.add("shapes", False, f"config.json: {err}")
    expected: dict[str, torch.Tensor] = {}  # the model's tensors, a tied copy once (as the exporter writes them)
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            expected[name] = t
    stored_as = names.inverse()  # the quantization_config names the artifact's modules
    try:
        stored = codec.layout(qcfg)
        layouts = {p: codec.layout_of(qcfg, stored_as.module(p)) for p in modules} if codec.mixed else {}
    except (KeyError, ValueError, TypeError, AttributeError, StopIteration, QuantkitError) as err:
        return v.add("layout", False, f"config.json: quantization_config: {type(err).__name__}: {first_line(err)}")
    packing, shapes, dtypes = [], [], []
    for prefix, parts in sorted(modules.items()):
        want = expected.pop(f"{prefix}.weight", None)
        if want is None:
            shapes.append(f"{prefix}: quantized, but config.json's model has no such Linear")
            continue
        wrong = layout.check_module(layouts.get(prefix, stored), prefix, parts, *want.shape)
        if wrong:  # decoding mistyped or misshapen words would only report an echo of this
            packing += wrong
            continue
        try:
            got = list(codec.decode_of(parts, qcfg, stored_as.module(prefix)).shape)
        except Exception as err:  # a decoder indexing missing or mis-shaped parts: report which module
            shapes.append(f"{prefix}: cannot decode ({type(err).__name__}: {first_line(err)})")
            continue
        if got != list(want.shape):
            shapes.append(f"{prefix}: decoded weight is {got}, config.json gives {list(want.shape)}")
    floats = {n: t for n, t in tensors.items() if n.rpartition(".")[0] not in modules or n.endswith(".bias")}
    kv = qcfg.get("kv_cache_scheme")
    if isinstance(kv, dict):  # an FP8 KV cache: its scales, float in any dtype (llm-compressor: the model's)
        for name, shape in sorted(kv_cache.expected_scales(model, str(kv.get("strategy"))).items()):
            t = floats.pop(name, None)
            if t is None:
                shapes.append(f"{name}: missing from the safetensors files (kv_cache_scheme needs it)")
            elif not t.is_floating_point() or list(t.shape) != shape:
                shapes.append(f"{name}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; kv_cache_scheme "
                              f"{kv.get('strategy')} stores a float {shape}")
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
    ok = v.add("layout", not packing, _more(packing) if packing else
               f"{len(modules)} quantized modules store the {stored.name} tensors, dtypes and shapes")
    ok = v.add("shapes", not shapes, _more(shapes) if shapes else
               f"{len(modules)} quantized modules and {len(floats)} float tensors match config.json") and ok
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
