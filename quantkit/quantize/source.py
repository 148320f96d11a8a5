"""Where a run's weights come from, and where a finished block goes.

`InMemory`: the whole model, loaded by transformers (GGUF files, small models). Blocks move to the compute device
and back; the artifacts are written from the model at the end.

`Streamed`: a safetensors checkpoint (one file or sharded), never loaded whole.
  - The skeleton is built on the meta device from config.json. Buffers are real: they are computed, not stored.
  - Each step materialises only what it needs, by tensor name through transformers' own loader
    (`convert_and_load_state_dict_in_model`), so its checkpoint-name conversions apply:
      - the modules outside the blocks (embeddings, ...), on first call, while block 0's inputs are captured;
      - one decoder block at a time, onto the compute device.
  - A finished block is appended to every format's artifact writer in `stored_keys` order (the tensors outside the
    blocks are read again from the checkpoint when their turn comes), then given back to the meta device.
Both write the same tensors in the same order, so their safetensors are byte-identical.
"""

from __future__ import annotations

import ctypes
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn

from ..errors import QuantkitError
from ..export.artifact import INDEX_NAME, WEIGHTS_NAME, ArtifactWriter, stored_keys
from ..families import moe
from ..model import decoder_blocks, load_config, load_tokenizer, meta_model
from ..untrusted import check_finite, weight_map

def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator policy does not apply
        return None


def _fixed_mmap_threshold() -> None:
    """Block-sized tensors (8-64 MB) fall under glibc's mmap threshold once it has adapted (up to 32 MB), land in
    per-thread heaps and stay resident after they are freed: a run's RSS then grows with every block.
    A fixed 1 MiB threshold gives every such tensor its own mapping, returned to the OS when it is freed."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _trim() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class InMemory:
    """The whole model in host memory. Made before the model loads: the allocator then returns the load's transients
    and each block's freed activations to the OS as the streamed path does, so RSS follows what is alive, which is
    what the memory plan counts (without it, glibc's heaps kept ~0.4 GiB over the plan on SmolLM2's GPTQ recipe)."""

    def __init__(self):
        _fixed_mmap_threshold()

    @contextmanager
    def capture(self):
        yield

    def load(self, i: int, block: nn.Module, device: torch.device) -> None:
        block.to(device)

    def done(self, i: int, block: nn.Module, qweights: dict) -> None:
        block.to("cpu")

    def restore(self, i: int, block: nn.Module, state: dict, qweights: dict) -> None:
        block.load_state_dict(state, strict=True)


def _own_memory(block: nn.Module) -> None:
    """A block read onto the CPU in its stored dtype is a view of the mapped shard: its pages count in RSS as
    file pages, and a weight GPTQ replaces keeps them resident beside its quantized copy until the whole block is
    released (a bf16 block twice over at the run's peak). Copied into memory of its own (which GPTQ can also park on
    disk, parking.py), the block leaves no mapping behind once the copies are made. A tensor cast on the way in
    is in memory of its own already; a mapped one's storage cannot be resized, which tells them apart."""
    for sub in block.modules():
        for name, p in sub._parameters.items():
            if p is not None and not p.untyped_storage().resizable():
                sub._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=False)


class Checkpoint:
    """A safetensors checkpoint's tensors by name. Files are opened only while a step reads from them: a handle
    maps its whole file, and every page a read touched would stay resident for as long as it is open."""

    def __init__(self, folder: Path):
        self.folder = folder
        file_of = weight_map(folder)  # every header checked, every file inside the folder
        if file_of is None:
            raise QuantkitError(f"model: {folder} has no {WEIGHTS_NAME} or {INDEX_NAME} "
                                "(load: stream reads safetensors checkpoints; use load: memory)")
        self.file_of = file_of

    @contextmanager
    def slices(self, keys: list[str]):
        """{key: lazy slice} of the given checkpoint keys, valid inside the block."""
        from safetensors import safe_open

        with ExitStack() as files:
            opened = {f: files.enter_context(safe_open(str(self.folder / f), "pt"))
                      for f in sorted({self.file_of[k] for k in keys})}
            yield {k: opened[self.file_of[k]].get_slice(k) for k in keys}


class Streamed:
    """A meta-device skeleton whose blocks are read from `folder`'s safetensors one at a time."""

    def __init__(self, folder: str, dtype: str):
        from transformers import GenerationConfig
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.folder = Path(folder)
        self.checkpoint = Checkpoint(self.folder)
        _fixed_mmap_threshold()
        config, self.dtype = load_config(folder, dtype)
        self.tokenizer = load_tokenizer(folder)
        self.model = meta_model(folder, config, self.dtype)
        # MoE: per-expert Linears, each read by its checkpoint name (the converters would fuse them again)
        self.names = moe.prepare(self.model)
        self._direct = {f"{name}.{k}" for name, experts in moe.experts_of(self.model)
                        for k, _ in experts.named_parameters()}
        gen = self.folder / "generation_config.json"
        self.generation_config = GenerationConfig.from_pretrained(folder) if gen.is_file() else None
        self.prefix, self.blocks = decoder_blocks(self.model)
        self.keys = stored_keys(self.model)  # computed once: loading and releasing replace Parameters
        self._position = {k: n for n, k in enumerate(self.keys)}
        self._by_block: dict[int, list[str]] = {}
        for k in self.keys:
            if k.startswith(f"{self.prefix}."):
                self._by_block.setdefault(int(k[len(self.prefix) + 1:].split(".", 1)[0]), []).append(k)

        # checkpoint key -> the model key it loads into, as transformers renames it
        self.mapping = get_model_conversion_mapping(self.model)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        meta = self.model.state_dict()
        self.sources: dict[str, list[str]] = {}
        for key in self.checkpoint.file_of:
            target, _ = rename_source_key(key, renamings, converters, self.model.base_model_prefix, meta)
            if target not in meta and key in meta:
                target = key
            self.sources.setdefault(target, []).append(key)
        for key in self._direct:
            self.sources[key] = [self.names(key)] if self.names(key) in self.checkpoint.file_of else []
        params = {name for name, _ in self.model.named_parameters()}
        missing = [k for k in self.keys if not self.sources.get(k) and k in params]
        if missing:
            raise QuantkitError(f"model: {self.folder} has no tensor for {missing[0]} (and {len(missing) - 1} more); "
                                "is it a checkpoint of this config.json?")
        self.writers: dict[str, ArtifactWriter] = {}
        self._next = 0  # position in self.keys of the next tensor the writers need

    def block_keys(self, i: int) -> list[str]:
        return self._by_block[i]

    # -- materialise and release --
    def _load(self, keys: list[str], device: torch.device | str) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        config = LoadStateDictConfig(dtype=self.dtype, weight_mapping=self.mapping, device_map={"": str(device)})
        direct = [k for k in keys if k in self._direct]
        with self.checkpoint.slices([ck for k in keys for ck in self.sources.get(k, [])]) as wanted:
            for key in direct:  # an expert's Linear: its checkpoint tensor as is, cast as transformers casts
                module, _, leaf = key.rpartition(".")
                target = self.model.get_submodule(module)
                t = wanted.pop(self.sources[key][0])[:]
                if tuple(t.shape) != tuple(target._parameters[leaf].shape):
                    want = tuple(target._parameters[leaf].shape)
                    raise QuantkitError(f"model: {self.folder}: tensor {self.sources[key][0]} has shape "
                                        f"{tuple(t.shape)}, config.json implies {want}")
                target._parameters[leaf] = nn.Parameter(t.to(device, self.dtype), requires_grad=False)
            info, _ = convert_and_load_state_dict_in_model(self.model, wanted, config)
        bad = sorted(info.mismatched_keys) or sorted(info.conversion_errors)
        if bad:
            raise QuantkitError(f"model: {self.folder}: tensor {bad[0][0] if isinstance(bad[0], tuple) else bad[0]} "
                                "does not match config.json")
        self.model.tie_weights()  # loading replaced the tied Parameter on one side

    def _release(self, module: nn.Module) -> None:
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is not None and p.device.type != "meta":
                    sub._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)
        self.model.tie_weights()
        _trim()

    @contextmanager
    def capture(self):
        """Modules outside the blocks get their weights on their first call; all go back to meta afterwards."""
        in_blocks = {id(m) for block in self.blocks for m in block.modules()}
        outer = [(name, m) for name, m in self.model.named_modules()
                 if id(m) not in in_blocks and any(p.device.type == "meta" for p in m.parameters(recurse=False))]

        def hook(name):
            def load(module, args):
                if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
                    self._load([f"{name}.{n}" for n, _ in module.named_parameters(recurse=False)], "cpu")
                    for n, p in module.named_parameters(recurse=False):  # before NaN spreads to every activation
                        check_finite(f"{name}.{n}", p)
            return load

        handles = [m.register_forward_pre_hook(hook(name)) for name, m in outer]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for _, m in outer:
                self._release(m)

    def load(self, i: int, block: nn.Module, device: torch.device) -> None:
        self._emit_before(i)
        self._load(self.block_keys(i), device)
        if torch.device(device).type == "cpu":
            _own_memory(block)

    def done(self, i: int, block: nn.Module, qweights: dict) -> None:
        """Block i is final: its tensors go to the writers, then the block and its entries of `qweights` (the run's,
        all blocks') go."""
        if self.writers:
            block.to("cpu")
            state = {f"{self.prefix}.{i}.{k}": v for k, v in block.state_dict().items()}
            self._emit_until(max(self._position[k] for k in state) + 1, state, qweights)
        self._release(block)
        for name in [n for n in qweights if n.startswith(f"{self.prefix}.{i}.")]:
            del qweights[name]  # written: the codes need not stay in memory

    def restore(self, i: int, block: nn.Module, state: dict, qweights: dict) -> None:
        """A block finished by a killed run, from its checkpoint: written as if it had just been quantized."""
        self._emit_before(i)
        block.load_state_dict(state, strict=True, assign=True)
        self.done(i, block, qweights)

    def finish(self) -> None:
        """The tensors after the last block (final norm, head)."""
        self._emit_until(len(self.keys), {}, {})

    def _emit_before(self, i: int) -> None:
        """What is stored before block i (the embeddings) is written and freed before the block is materialised."""
        self._emit_until(self._position[self.block_keys(i)[0]], {}, {})

    def _emit_until(self, end: int, state: dict, qweights: dict) -> None:
        if not self.writers:  # a rank other than 0 under several processes: rank 0 writes
            self._next = end
            return
        for key in self.keys[self._next:end]:
            if key not in state:
                if key.startswith(f"{self.prefix}."):
                    raise QuantkitError(f"model: {key} is stored between two blocks; use load: memory")
                module = self.model.get_submodule(key.rpartition(".")[0])
                self._load([key], "cpu")
                t = self.model.get_parameter_or_buffer(key).detach()
                for writer in self.writers.values():
                    writer.add(key, t, qweights)
                self._release(module)
                continue
            for writer in self.writers.values():
                writer.add(key, state[key], qweights)
        self._next = end
