"""Packing round-trips and the two checkpoint layouts, checked against reference readers written
from the published formats (tests/reference_readers.py), not against quantkit's own unpacker."""

import json

import pytest
import torch

from quantkit.algorithms.gptq import GPTQ, Hessian
from quantkit.algorithms.grid import GridSpec
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.export import compressed_tensors, gptq, packing
from quantkit.export.artifact import write_safetensors
from quantkit.export.base import QuantInfo
from reference_readers import read_compressed_tensors, read_gptq


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_dense_packing_round_trips(bits, dim):
    shape = (64, 96) if dim == 0 else (96, 64)
    values = torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(bits))
    packed = packing.pack(values, bits, dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == 64 * bits // 32
    assert torch.equal(packing.unpack(packed, bits, 64, dim), values)


def test_packing_matches_compressed_tensors_library():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for bits in (2, 3, 4, 8):  # 3 bits: values cross words in both
        codes = torch.randint(0, 2**bits, (24, 96))
        signed = (codes - 2 ** (bits - 1)).to(torch.int8)
        assert torch.equal(packing.pack(codes, bits, 1), pack_to_int32(signed, bits))
        assert torch.equal(packing.pack(codes, bits, 0), pack_to_int32(signed, bits, packed_dim=0))


def test_gptq_4bit_word_layout_by_hand():
    codes = torch.arange(8).repeat(4, 1).T  # [in=8, out=4]: column o holds 0..7
    word = int(packing.pack(codes, 4, dim=0)[0, 0]) & 0xFFFFFFFF
    assert word == 0x76543210  # value j at bits 4j, lowest first


def quantized(spec: GridSpec, act_order: bool, out=64, cols=128):
    g = torch.Generator().manual_seed(spec.bits * 7 + spec.group_size + act_order)
    w = torch.randn(out, cols, generator=g)
    h = Hessian(cols)
    h.add(torch.randn(512, cols, generator=g) * torch.linspace(0.1, 3, cols))
    return GPTQ(h.value(), spec, act_order=act_order).quantize(w)[0]


COMBOS = [(GridSpec(b, g, s), a) for b in (2, 3, 4, 8) for g in (-1, 32, 64, 128) for s in (True, False)
          for a in (False, True)]


def same(a, b):
    return torch.equal(a.codes, b.codes) and torch.equal(a.zero, b.zero) and torch.equal(a.scale.half(), b.scale.half())


@pytest.mark.parametrize("spec, act_order", COMBOS, ids=lambda x: str(x))
def test_formats_round_trip_bit_exact_and_agree_with_reference_readers(tmp_path, spec, act_order):
    qw = quantized(spec, act_order)
    info = QuantInfo("gptq", spec, act_order=act_order, damp=0.01)
    formats = [("gptq", gptq, gptq.encode({"m.proj": qw}, info), read_gptq)]
    enc = compressed_tensors.encode({"m.proj": qw}, info, torch.float32)
    formats.append(("ct", compressed_tensors, enc, read_compressed_tensors))
    for name, fmt, enc, reference_reader in formats:
        parts = {k.split(".", 2)[2]: v for k, v in enc.tensors.items()}
        assert same(fmt.decode_module(parts, enc.quantization_config), qw), name
        folder = tmp_path / name
        folder.mkdir()
        write_safetensors(folder, enc.tensors, 1 << 30)
        (folder / "config.json").write_text(json.dumps({"quantization_config": enc.quantization_config}))
        assert torch.equal(reference_reader(str(folder))["m.proj"], qw.dequantize()), name


def test_gptq_zero_point_convention():
    spec = GridSpec(4, 32, sym=False)
    w = torch.randn(32, 64)
    w[:, :32] = w[:, :32].abs() + 0.1  # an all-positive group: asymmetric zero point 0
    qw = rtn_quantize(w, spec)
    assert int(qw.zero.min()) == 0
    assert gptq.checkpoint_format(QuantInfo("rtn", spec)) == "gptq_v2"  # v1 stores zero-1 and cannot hold 0
    stored = packing.unpack(gptq.encode_module(qw, "gptq_v2")["qzeros"], 4, 32, dim=1).T
    assert torch.equal(stored, qw.zero.long())
    sym = rtn_quantize(w, GridSpec(4, 32, sym=True))
    assert gptq.checkpoint_format(QuantInfo("rtn", sym.spec)) == "gptq"
    stored = packing.unpack(gptq.encode_module(sym, "gptq")["qzeros"], 4, 32, dim=1)
    assert torch.all(stored == 7)  # symmetric 4-bit zero 8, stored as 7 in v1


def test_compressed_tensors_asym_decompresses_with_the_library():
    """compressed-tensors' own decompressor (an independent implementation) on our asym layout."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    spec = GridSpec(4, 32, sym=False)
    qw = quantized(spec, act_order=False)
    enc = compressed_tensors.encode({"m": qw}, QuantInfo("gptq", spec), torch.float32)
    scheme = QuantizationScheme.model_validate(enc.quantization_config["config_groups"]["group_0"])
    parts = {k.split(".", 1)[1]: v for k, v in enc.tensors.items()}
    out = PackedQuantizationCompressor.decompress(parts, scheme)
    assert torch.equal(out["weight"].float(), qw.dequantize())


@pytest.mark.parametrize("seed", range(12))
def test_spooled_shards_are_the_files_safetensors_writes(tmp_path, seed):
    """Artifact shards are written from a spool on disk (nothing held in memory); the file is save_file's, byte for
    byte, whatever the dtypes, shapes (0-d, empty) and names, and however they sort."""
    import random

    from safetensors.torch import save_file

    rnd = random.Random(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8, torch.int8, torch.int64,
              torch.float8_e4m3fn, torch.bool]
    tensors = {}
    for i in range(rnd.randint(0, 10)):
        shape = [rnd.randint(0, 5) for _ in range(rnd.randint(0, 3))]
        name = f"{rnd.choice(['model.layers', 'lm_head', 'Z', 'é'])}.{i}.{rnd.randint(0, 99)}"
        tensors[name] = (torch.randn(shape) * 10).to(rnd.choice(dtypes))
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    (tmp_path / "out").mkdir()
    assert write_safetensors(tmp_path / "out", tensors, 1 << 30) == ["model.safetensors"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert not list((tmp_path / "out").glob(".*"))  # no spool left behind
    # past max_shard_size (here 1 byte: every tensor of 2 bytes or more is a shard of its own): greedy shards in
    # arrival order, each save_file's file of its tensors
    tensors = {k: t for k, t in tensors.items() if t.numel() * t.element_size() > 1}
    if len(tensors) >= 2:
        (tmp_path / "sharded").mkdir()
        names = write_safetensors(tmp_path / "sharded", tensors, 1)
        assert names[-1] == "model.safetensors.index.json" and len(names) == len(tensors) + 1
        for (name, t), shard in zip(tensors.items(), names):
            save_file({name: t}, str(tmp_path / "one.safetensors"), metadata={"format": "pt"})
            assert (tmp_path / "sharded" / shard).read_bytes() == (tmp_path / "one.safetensors").read_bytes()
