"""Checks of what a model folder says about itself, made before anything acts on it: a model downloaded from
anywhere is untrusted input. Each parses only headers (no tensor data) and fails with one line naming the file and
the field: config.json (no custom code, counts and dimensions within sane bounds), the shard index (every entry a
file inside the folder), every safetensors header (against the format's spec), a GGUF file's metadata and tensor
table. Also the weights an artifact keeps (finite) and the options that depend on the model (positions)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .errors import QuantkitError, first_line

SAFETENSORS_INDEX = "model.safetensors.index.json"
INDEXES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")
MAX_HEADER = 100_000_000  # safetensors' own MAX_HEADER_SIZE: a longer one is refused by the library too
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64}
# far above any released model (Llama 3.1 405B: 126 layers, hidden 16384, MLP 53248; vocabularies up to 262144;
# contexts up to 10M), far below what would exhaust memory building the skeleton or its buffers
BOUNDS = {
    "num_hidden_layers": 1024, "n_layer": 1024, "num_layers": 1024,
    "hidden_size": 1 << 16, "n_embd": 1 << 16, "d_model": 1 << 16, "word_embed_proj_dim": 1 << 16,
    "intermediate_size": 1 << 18, "moe_intermediate_size": 1 << 18, "ffn_dim": 1 << 18, "n_inner": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "n_head": 1024, "head_dim": 4096,
    "vocab_size": 1 << 21,
    "max_position_embeddings": 1 << 25, "n_positions": 1 << 25,
    "num_experts": 4096, "num_local_experts": 4096, "n_routed_experts": 4096, "num_experts_per_tok": 4096,
}


def _bad(path: Path | str, what: str) -> QuantkitError:
    return QuantkitError(f"{path}: {what}")


def read_json(path: Path):
    """A JSON file a model or artifact brought: UTF-8, valid, no key twice (a second one would silently win)."""
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            raise ValueError(f"key {dup!r} appears twice")
        return dict(pairs)

    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicates)
    except OSError as err:
        raise _bad(path, f"unreadable ({first_line(err)})") from None
    except UnicodeDecodeError as err:
        raise _bad(path, f"byte {err.start} is not UTF-8; expected a JSON text") from None
    except (ValueError, RecursionError) as err:
        raise _bad(path, f"not valid JSON ({first_line(err)}); expected a JSON object") from None


def check_config(path: Path) -> dict:
    """config.json: a JSON object, no custom code, every count and dimension an integer within BOUNDS."""
    from transformers import CONFIG_MAPPING

    from .families import supported

    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise _bad(path, f"is a JSON {type(cfg).__name__}; expected an object")
    model_type = cfg.get("model_type")
    # an auto_map next to a model_type transformers knows (Phi-3's hub config) is ignored: its own classes load
    if "auto_map" in cfg and not (isinstance(model_type, str) and model_type in CONFIG_MAPPING):
        raise _bad(path, f"auto_map names custom code for model_type {model_type!r}; quantkit never runs a model's "
                         f"own code (supported: {supported()})")

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif key in BOUNDS and value is not None:
                per_layer = value if isinstance(value, list) else [value]  # some families give one per layer
                if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= BOUNDS[key]
                           for v in per_layer):
                    raise _bad(path, f"{prefix}{key} is {value!r:.40}; expected an integer from 0 to "
                                     f"{BOUNDS[key]}")

    walk(cfg, "")
    return cfg


def inside(folder: Path, name: object, where: str) -> Path:
    """folder/name, which must be a file inside folder once symlinks are resolved. A Hugging Face cache snapshot's
    files are symlinks into the same repository's blobs/ folder: those are inside too."""
    if not isinstance(name, str) or not name:
        raise QuantkitError(f"{where} is {name!r}; expected a file name")
    root = folder.resolve()
    target = (folder / name).resolve()
    roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    if not any(target.is_relative_to(r) for r in roots):
        raise QuantkitError(f"{where} {name!r} resolves to {target}, outside the model folder {root}")
    if not target.is_file():
        raise QuantkitError(f"{where} {name!r} is not a file in {folder}")
    return target


def safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {dtype, shape, data_offsets}} of a safetensors file, checked against the format's spec: an
    8-byte little-endian header length, a JSON object, tensors that tile the data that follows exactly."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, f"{size} bytes; expected an 8-byte header length and a header")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, size - 8):
            raise _bad(path, f"header length {n}; expected at most {min(MAX_HEADER, size - 8)} (the file's "
                             f"{size} bytes, at most {MAX_HEADER})")
        raw = f.read(n)
    if not raw.startswith(b"{"):
        raise _bad(path, f"header starts with {raw[:8]!r}; expected a JSON object")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise _bad(path, f"header is not JSON ({first_line(err)}); expected a JSON object") from None
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(path, "__metadata__ is not a mapping of strings")
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} is {info!r:.60}; expected {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise _bad(path, f"tensor {name!r} has dtype {dtype!r}; expected one of {', '.join(DTYPE_BITS)}")
        if not _ints(shape):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}; expected a list of non-negative integers")
        if not (_ints(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end]")
        nbytes = math.prod(shape) * DTYPE_BITS[dtype] // 8
        if offsets[1] - offsets[0] != nbytes:
            raise _bad(path, f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes; its {dtype} shape {shape} "
                             f"takes {nbytes}")
        if offsets[1] > size - 8 - n:
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets}, outside the file's {size - 8 - n} data "
                             "bytes")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):  # the spec: the tensors tile the data, no overlaps, no gaps
        if begin != end:
            raise _bad(path, f"tensor {name!r} starts at data byte {begin}, "
                             f"{'inside the tensor before it' if begin < end else 'after a gap'}; expected {end}")
        end = stop
    if end != size - 8 - n:
        raise _bad(path, f"tensors take {end} data bytes, the file holds {size - 8 - n}")
    return header


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64
                                           for v in value)  # the library reads them as 64-bit unsigned


def weight_map(folder: Path) -> dict[str, str] | None:
    """{tensor name: file name} of a folder's safetensors checkpoint (its index, else model.safetensors), every
    file checked; None when it has neither. A .bin index's entries are checked to stay inside the folder."""
    bin_index = folder / INDEXES[1]
    if bin_index.is_file():
        _index(folder, bin_index)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        file_of = _index(folder, index)
        headers = {f: safetensors_header(inside(folder, f, f"{index}: weight_map entry")) for f in set(file_of.values())}
        for key, f in file_of.items():
            if key not in headers[f]:
                raise _bad(index, f"weight_map puts {key!r} in {f}, which holds no such tensor")
        return file_of
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors").is_symlink():  # dangling too
        path = inside(folder, "model.safetensors", str(folder))
        return {k: "model.safetensors" for k in safetensors_header(path)}
    return None


def _index(folder: Path, index: Path) -> dict[str, str]:
    body = read_json(index)
    file_of = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(file_of, dict) or not file_of:
        raise _bad(index, f"weight_map is {file_of!r:.40}; expected a mapping of tensor name to shard file")
    for key, name in file_of.items():
        inside(folder, name, f"{index}: weight_map[{key!r}]")
    return file_of


def check_gguf(path: Path) -> None:
    """A GGUF file's metadata and tensor table parse, and every tensor lies inside the file."""
    from transformers.integrations.gguf.reader import GgufHeader

    size = path.stat().st_size
    try:
        header = GgufHeader.from_file(str(path))
    except Exception as err:  # its parser raises struct.error, ValueError, KeyError ... on a truncated file
        raise _bad(path, f"not a readable GGUF file ({type(err).__name__}: {first_line(err)})") from None
    for t in header.tensors:
        if header.data_start + t.offset + t.nbytes > size:
            raise _bad(path, f"tensor '{t.name}' ends at byte {header.data_start + t.offset + t.nbytes}; the file "
                             f"has {size} (truncated?)")


def check_model(folder: str, gguf: str | None) -> None:
    """Every header of a local model (a folder, or a GGUF file in it) checked; a hub id is not local."""
    path = Path(folder)
    if gguf:
        check_gguf(path / gguf)
    elif path.is_dir():
        check_config(path / "config.json")
        weight_map(path)


def check_finite(name: str, t: torch.Tensor) -> None:
    """A float tensor an artifact keeps holds no NaN or inf: the artifact would not load (verify fails it)."""
    if not t.is_floating_point():
        return
    # torch has no isfinite kernel for the 1-byte floats (FP8 weights): test them widened, a slice at a time
    parts = t.reshape(-1).split(1 << 22) if t.element_size() == 1 else [t]
    bad = sum(int((~torch.isfinite(part.float() if t.element_size() == 1 else part)).sum()) for part in parts)
    if bad:
        raise QuantkitError(f"model: {name} holds {bad} non-finite values (NaN or inf); expected finite weights")


def check_positions(config, tokens: int, field: str, model: str) -> None:
    """tokens in one sequence fit the model's learned or trained positions."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise QuantkitError(f"{field}: {tokens} tokens per sequence; {model} has max_position_embeddings {limit}")
