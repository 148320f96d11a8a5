"""Property tests of the untrusted-input parsers on bytes, not data: a safetensors file's header (random bytes,
mutations of a valid file, valid JSON with wrong fields) and a recipe's YAML text. Every outcome is success or a
one-line QuantkitError naming the file; a header quantkit accepts is one the safetensors library reads in full.
(test_recipe_fuzz.py fuzzes the recipe's parsed data.)"""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save

from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe, load_recipe
from quantkit.untrusted import DTYPE_BITS, safetensors_header

FUZZ = settings(max_examples=100, deadline=3000)  # a few seconds each on an idle machine
VALID = save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16),
              "c": torch.zeros(0, 3, dtype=torch.int64)}, metadata={"format": "pt"})


def one_line_or_none(check, text: bytes, suffix: str):
    """check(path) on a file holding text: its result, or None after a one-line QuantkitError naming the file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"f{suffix}"
        path.write_bytes(text)
        try:
            return check(path)
        except QuantkitError as err:
            assert len(str(err).splitlines()) == 1 and str(err).startswith(f"{path}"), str(err)
            return None


def read_all(path: Path) -> dict:
    """The property: what quantkit's check accepts, the library reads, every tensor."""
    header = safetensors_header(path)
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(header)
        for k in f.keys():
            assert list(f.get_tensor(k).shape) == header[k]["shape"]
    return header


def test_the_valid_file_reads():
    assert set(one_line_or_none(read_all, VALID, ".safetensors")) == {"a", "b", "c"}


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(data):
    one_line_or_none(read_all, data, ".safetensors")


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["set", "insert", "delete", "truncate"]), st.integers(0, len(VALID)),
                          st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_bytes(edits):
    data = bytearray(VALID)
    for op, at, value in edits:
        at = min(at, len(data))
        if op == "set" and at < len(data):
            data[at] = value
        elif op == "insert":
            data.insert(at, value)
        elif op == "delete" and at < len(data):
            del data[at]
        elif op == "truncate":
            del data[at:]
    one_line_or_none(read_all, bytes(data), ".safetensors")


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2, 1 << 65) | st.floats() | st.text(max_size=5),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                           max_leaves=6)
fields = {
    "dtype": st.sampled_from([*DTYPE_BITS, "F13", "f32", ""]) | json_values,
    "shape": st.lists(st.integers(0, 8), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(0, 80), min_size=2, max_size=2) | json_values,
}


@FUZZ
@given(st.data())
def test_wrong_header_fields(data):
    n = int.from_bytes(VALID[:8], "little")
    header, body = json.loads(VALID[8:8 + n]), VALID[8 + n:]
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(sorted(header)))
        if not isinstance(header[name], dict) or name == "__metadata__" or data.draw(st.booleans()):
            header[name] = data.draw(json_values)
        else:
            key = data.draw(st.sampled_from(sorted(fields)))
            header[name] = dict(header[name]) | {key: data.draw(fields[key])}
    text = json.dumps(header).encode()
    body = body[:data.draw(st.integers(0, len(body)))] if data.draw(st.booleans()) else body
    one_line_or_none(read_all, len(text).to_bytes(8, "little") + text + body, ".safetensors")


RECIPE = """\
model: m
dtype: float32
calibration: {dataset: wikitext2, num_samples: 8, seq_len: 64}
stages:
  - gptq: {bits: 4, group_size: 64, ignore: [lm_head]}
export:
  output: o
  formats: [gptq, compressed-tensors]
"""
yaml_bits = st.sampled_from(["&a ", "*a", "<<: *a\n", "dtype: x\n", "model: n\n", ": ", "- ", "{", "}", "[", "]",
                             "\n", "  ", "\t", "!!python/object:os.system ", "!!binary ", "? ", "|\n", "'", '"', "#",
                             "%YAML 1.1\n", "---\n", "...\n", "\x00", "\ufeff", "é"]) | st.text(max_size=4)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(RECIPE)), st.integers(0, 6), yaml_bits), max_size=4))
def test_mutated_recipe_yaml(edits):
    text = RECIPE
    for at, cut, insert in edits:
        text = text[:at] + insert + text[at + cut:]
    recipe = one_line_or_none(load_recipe, text.encode("utf-8", "surrogatepass"), ".yaml")
    assert recipe is None or isinstance(recipe, Recipe)


@pytest.mark.parametrize("text", [
    "a: &a [x, x]\nb: [*a, *a]\n",  # an expansion bomb's first step
    "model: m\nmodel: n\n",
    "[" * 1000 + "]" * 1000,  # deeper than the parser's recursion
], ids=["alias", "duplicate key", "deep nesting"])
def test_yaml_the_fuzzer_may_miss(text):
    assert one_line_or_none(load_recipe, text.encode(), ".yaml") is None
