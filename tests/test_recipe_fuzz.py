"""Property tests of the recipe parser: whatever YAML-like data it gets, parse_recipe returns a Recipe or raises a
one-line QuantkitError that names the field path (or the unknown key), never any other exception."""

import copy
import re
from datetime import date

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe, parse_recipe

SOURCE = "fuzz.yaml"
# what follows "fuzz.yaml: ": a field path (keys a user chose may be quoted), an unknown key, or the one
# whole-document complaint
NAMED = re.compile(rf"({'|'.join(Recipe.model_fields)})(\..*?)?: |unknown key |expected a mapping ")

W8A8 = {"bits": 8, "group_size": -1, "activations": {"type": "int"}}
VALID = [
    {"model": "m", "calibration": {"dataset": "wikitext2", "num_samples": 8, "seq_len": 64},
     "stages": [{"gptq": {"bits": 4, "group_size": 64, "act_order": True, "ignore": ["lm_head"]}}],
     "export": {"output": "o", "formats": ["gptq", "compressed-tensors"], "max_shard_size": "2GB"}},
    {"model": "m", "dtype": "bfloat16", "device": "cpu", "calibration": {"dataset": "c.jsonl", "text_field": "t"},
     "stages": [{"smoothquant": {"alpha": 0.5, "ignore": []}}, {"rtn": W8A8}],
     "export": {"output": "o", "formats": ["compressed-tensors"], "dtype": "float16"}},
    {"model": "m", "calibration": {},
     "stages": [{"awq": {"group_size": 64}}, {"gptq": {"bits": 4, "group_size": 64, "sym": False}}],
     "export": {"output": "o", "formats": ["awq", "gptq"]}},
    {"model": "m", "stages": [{"rtn": {"bits": 8, "group_size": -1, "type": "float", "activations": {"type": "float"}}}],
     "export": {"output": "o"},
     "release": {"format": "compressed-tensors", "eval": {"tasks": ["arc_easy"], "limit": 100}, "bench": {"batches": [1]}},
     "gates": {"ppl_increase_pct": 5, "tasks": {"arc_easy": {"min_ratio": 0.95}}, "decode_speedup_min": 1.5}},
]

leaves = (st.none() | st.booleans() | st.integers(-300, 300) | st.integers() | st.floats(allow_nan=True)
          | st.text(max_size=8) | st.dates() | st.sampled_from(["4", "2GB", "int", "gptq"]))  # dates: YAML has them
values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(leaves, children, max_size=3),
    max_leaves=12,
)
field_names = st.sampled_from(["model", "dtype", "device", "calibration", "stages", "export", "gptq", "rtn", "awq",
                               "smoothquant", "alpha", "activations", "type", "bits", "group_size", "formats",
                               "output", "num_samples", "max_shard_size", "release", "gates", "tasks", "eval",
                               "bench", "x"]) | st.text(max_size=6)


def parse(data):
    """The property: a Recipe, or a one-line QuantkitError naming what is wrong."""
    try:
        return parse_recipe(data, SOURCE)
    except QuantkitError as err:
        msg = str(err)
        assert len(msg.splitlines()) == 1 and msg.startswith(f"{SOURCE}: "), msg
        assert NAMED.match(msg.removeprefix(f"{SOURCE}: ")), msg
        return None


def paths(node, prefix=()):
    """Every path into nested dicts / lists (the root included)."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from paths(child, (*prefix, key))


def replace(root, path, value):
    if not path:
        return value
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return root


def test_the_valid_recipes_parse():
    assert all(isinstance(parse(copy.deepcopy(r)), Recipe) for r in VALID)


WRONG = [None, True, 0, -1, 2.5, float("nan"), 10**400, "x", "", "\n", "\r", "infGB", "-1GB", "0KB", [], {}, ["x"],
         {"x": 1}, {"\n": 1}, {1.5: {}}, {None: {}}, {date(2024, 1, 1): {}}, [{}], {"gptq": {}}]


@pytest.mark.parametrize("base", range(len(VALID)))
def test_every_path_with_every_wrong_type(base):
    for path in list(paths(VALID[base])):
        for value in WRONG:
            parse(replace(copy.deepcopy(VALID[base]), path, copy.deepcopy(value)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_recipes(data):
    recipe = copy.deepcopy(data.draw(st.sampled_from(VALID)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths(recipe))))
        node = recipe
        for key in path:
            node = node[key]
        op = data.draw(st.sampled_from(["drop", "replace", "add key"]))
        if op == "drop" and path:
            parent = recipe
            for key in path[:-1]:
                parent = parent[key]
            del parent[path[-1]]
        elif op == "add key" and isinstance(node, dict):
            node[data.draw(field_names)] = data.draw(values)
        else:
            recipe = replace(recipe, path, data.draw(values))
    parse(recipe)


@settings(max_examples=300, deadline=None)
@given(values | st.dictionaries(field_names, values, max_size=6))
def test_arbitrary_data(data):
    parse(data)
