"""Evidence across domains: the bundled domains, calibration mixtures, chat formatting, the self domain and
per-domain gates."""

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli, write_recipe
from quantkit import data, self_text
from quantkit.errors import QuantkitError
from quantkit.progress import Reporter
from quantkit.quantize import calibration
from quantkit.recipe import Calibration
from tiny_models import make_tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
CONVERSATIONS = [[{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}],
                 [{"role": "user", "content": "And an even one?"}, {"role": "assistant", "content": "Two."}]]


@pytest.fixture
def short_replies(monkeypatch):
    """Self text from a tiny random model: 32-token replies are enough (it rarely says end-of-sequence)."""
    monkeypatch.setattr(self_text, "MAX_NEW_TOKENS", 32)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_every_bundled_domain_has_disjoint_splits_and_a_source_note(tok):
    for name, (calib, test) in data.DOMAINS.items():
        assert (data.BUNDLED / Path(calib).parent / "SOURCE.md").is_file(), name
        a = data.read_text(data.resolve(name, "calibration", "x"), render_chat=data.plain_chat)
        b = data.read_text(data.resolve(name, "eval", "x"), render_chat=data.plain_chat)
        assert len(b) > 150_000, name  # at least 40 windows of 512 tokens of a real tokenizer
        docs = {d.strip() for d in a.split("\n\n") if len(d.strip()) > 200}
        assert not docs & {d.strip() for d in b.split("\n\n")}, f"{name}: a paragraph is in both splits"
    assert data.expand(["code", "suite", "code"]) == ["code", "wikitext2", "fiction", "chat", "math", "self"]


def test_mixture_sampling_follows_the_weights_and_is_deterministic(tok, tmp_path):
    assert calibration.shares([0.5, 0.3, 0.2], 10) == [5, 3, 2]
    assert calibration.shares([1, 1, 1], 8) == [3, 3, 2] and sum(calibration.shares([0.7, 0.2, 0.1], 7)) == 7
    letters, digits = tmp_path / "letters.txt", tmp_path / "digits.txt"
    letters.write_text(" ".join(["alpha beta gamma delta"] * 400))
    digits.write_text(" ".join(["1 2 3 4 5 6 7 8 9"] * 400))
    cfg = Calibration(dataset=[{"dataset": str(letters), "weight": 3}, {"dataset": str(digits), "weight": 1}],
                      num_samples=8, seq_len=16, seed=3)
    first, again = calibration.build(tok, cfg), calibration.build(tok, cfg)
    assert torch.equal(first.tokens, again.tokens) and first.sha256 == again.sha256
    texts = [tok.decode(row) for row in first.tokens]
    assert [any(c.isdigit() for c in t) for t in texts] == [False] * 6 + [True] * 2
    assert [p["windows"] for p in first.parts] == [6, 2] and first.source.startswith("mixture of ")
    other = calibration.build(tok, cfg.model_copy(update={"seed": 4}))
    assert not torch.equal(other.tokens, first.tokens)
    # a single source draws the windows it drew before mixtures existed (part 0 keeps the recipe's seed)
    single = calibration.build(tok, Calibration(dataset=str(letters), num_samples=4, seq_len=16, seed=3))
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor(tok(letters.read_text(), add_special_tokens=False)["input_ids"])
    starts = torch.randint(0, ids.numel() - 15, (4,), generator=gen)
    assert torch.equal(single.tokens, torch.stack([ids[s: s + 16] for s in starts.tolist()]))
    with pytest.raises(QuantkitError, match=r"calibration.dataset: part '.*digits.txt' gets no window of 8"):
        calibration.build(tok, cfg.model_copy(update={"dataset": [cfg.dataset[0], cfg.dataset[1].model_copy(
            update={"weight": 0.01})]}))


def test_the_bundled_mixture_draws_every_domain(tok):
    cfg = Calibration(dataset="mixture", num_samples=20, seq_len=32)
    got = calibration.build(tok, cfg)
    assert [p["dataset"] for p in got.parts] == list(data.MIXTURE)
    assert sum(p["windows"] for p in got.parts) == 20 and got.tokens.shape == (20, 32)


def test_chat_rows_are_formatted_with_the_template(tok, tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    assert data.read_text(rows, render_chat=data.chat_renderer(tok, None)) == (
        "User: Name a prime.\nAssistant: Seven.\n\nUser: And an even one?\nAssistant: Two.")  # no template: plain
    with pytest.raises(QuantkitError, match="calibration.chat_template: true, but the tokenizer has no chat template"):
        data.chat_renderer(tok, True)
    tok.chat_template = TEMPLATE
    try:
        text = data.read_text(rows, render_chat=data.chat_renderer(tok, None))
        assert text == ("<s>user\nName a prime.</s>\n<s>assistant\nSeven.</s>\n\n\n"
                        "<s>user\nAnd an even one?</s>\n<s>assistant\nTwo.</s>\n")
        assert data.read_text(rows, render_chat=data.chat_renderer(tok, False)).startswith("User: Name a prime.")
        # in calibration: the template's special tokens are tokens, not characters
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        cfg = Calibration(dataset=[{"dataset": str(rows), "weight": 1}], num_samples=1, seq_len=n)
        ids = calibration.build(tok, cfg).tokens[0].tolist()  # the one window is the whole text
        assert ids.count(tok.convert_tokens_to_ids("<s>")) == 4 and ids[0] == tok.convert_tokens_to_ids("<s>")
    finally:
        tok.chat_template = None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(QuantkitError, match=r"^x: .*bad.jsonl line 1: 'messages' must be a non-empty list"):
        data.read_text(bad, field="x")


def test_self_text_is_reproducible_from_its_seed_and_keyed_by_the_model(tmp_path, tiny_llama, short_replies):
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    get = lambda model, seed=0: self_text.tokens(str(model), 300, "calibration", "float32", torch.device("cpu"),  # noqa: E731
                                                 Reporter(quiet=True), seed=seed, root=tmp_path / "cache",
                                                 batch_size=4)
    first = get(tiny_llama)
    entries = list((tmp_path / "cache" / "self-text").iterdir())
    assert first.shape == (300,) and len(entries) == 1
    # the cache hit returns the same ids; regenerating from the seed does too
    assert torch.equal(get(tiny_llama), first)
    for e in entries:
        for f in e.iterdir():
            f.unlink()
        e.rmdir()
    assert torch.equal(get(tiny_llama), first)
    assert not torch.equal(get(tiny_llama, seed=1), first)
    get(other)
    assert len(list((tmp_path / "cache" / "self-text").iterdir())) == 3  # seed 1 and the other model: new entries
    eval_ids = self_text.tokens(str(tiny_llama), 300, "eval", "float32", torch.device("cpu"), Reporter(quiet=True),
                                root=tmp_path / "cache", batch_size=4)
    assert not torch.equal(eval_ids, first)  # evaluation never scores the calibration samples


def test_eval_reports_every_domain_and_the_first_at_the_top(monkeypatch, tmp_path, tiny_llama, short_replies):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "e.json"
    code = run_cli(monkeypatch, "eval", tiny_llama, "--base", tiny_llama, "--dataset", "code", "--dataset", "chat",
                   "--dataset", "self", "--seq-len", "64", "--max-tokens", "256", "--self-tokens", "192",
                   "--no-generation", "--quiet", "--json", out)
    body = json.loads(out.read_text())
    assert code == 0 and list(body["domains"]) == ["code", "chat", "self"] == list(body["datasets"])
    assert body["ppl"] == body["domains"]["code"]["ppl"]
    assert [body["domains"][d]["windows"] for d in body["domains"]] == [4, 4, 3]
    for m in body["domains"].values():  # the base against itself
        assert m["kld"]["mean"] < 1e-6 and m["same_top"] == 1.0
    ppl = {d: m["ppl"]["base"] for d, m in body["domains"].items()}
    assert len(set(ppl.values())) == 3  # three different texts


def test_a_missing_or_short_domain_gets_a_one_line_error(monkeypatch, tmp_path, tiny_llama, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    for args, message in [
        (["--dataset", str(tmp_path / "nope.txt")], f"--dataset {tmp_path / 'nope.txt'}: file not found"),
        (["--dataset", str(short)], f"--dataset {short}: 6 tokens, fewer than one window of --seq-len 64"),
        (["--dataset", "self"], "--dataset self: text the original model writes; pass --base"),
    ]:
        code = run_cli(monkeypatch, "eval", tiny_llama, "--seq-len", "64", "--quiet", *args)
        err = capsys.readouterr().err.strip()
        assert code != 0 and err.startswith(f"error: {message}") and "\n" not in err, err


def test_quality_gates_hold_on_every_domain_and_name_it():
    from quantkit.gates import evaluate, table
    from quantkit.recipe import Gates

    domains = {"wikitext2": {"ppl": {"model": 11.0, "base": 10.0}, "kld": {"mean": 0.05}, "same_top": 0.9},
               "code": {"ppl": {"model": 13.0, "base": 10.0}, "kld": {"mean": 0.25}, "same_top": 0.7}}
    got = {r.name: r for r in evaluate(Gates(ppl_increase_pct=20, kld_mean_max=0.2), {"domains": domains}, None)}
    assert got["ppl_increase_pct[wikitext2]"].passed and not got["ppl_increase_pct[code]"].passed
    assert got["kld_mean_max[wikitext2]"].passed and not got["kld_mean_max[code]"].passed
    assert got["ppl_increase_pct[code]"].measured == pytest.approx(30)
    # per_domain relaxes code only; a gate for a domain that was not evaluated fails as not measured
    gates = Gates(ppl_increase_pct=20, kld_mean_max=0.2, per_domain={"code": {"ppl_increase_pct": 35},
                                                                     "math": {"kld_mean_max": 0.1}})
    got = {r.name: r for r in evaluate(gates, {"domains": domains}, None)}
    assert got["ppl_increase_pct[code]"].passed and got["ppl_increase_pct[code]"].required == 35
    assert not got["kld_mean_max[code]"].passed and got["kld_mean_max[code]"].required == 0.2
    assert not got["kld_mean_max[math]"].passed and got["kld_mean_max[math]"].detail == "not measured"
    lines = table(list(got.values())).splitlines()
    assert any(line.startswith("ppl_increase_pct[code]") and line.endswith("pass") for line in lines)
    assert any(line.startswith("kld_mean_max[code]") and line.endswith("FAIL") for line in lines)


def test_release_evaluates_the_suite_and_gates_each_domain(monkeypatch, tmp_path, tiny_llama, short_replies):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "rtn: {bits: 4, group_size: 32}",
                          formats=("compressed-tensors",))
    recipe.write_text(recipe.read_text() + (
        "release: {eval: {seq_len: 64, max_tokens: 256, self_tokens: 128, generation: false}, bench: {enabled: false}}\n"
        "gates: {kld_mean_max: 1.0, per_domain: {self: {kld_mean_max: 0.0}}}\n"))
    code = run_cli(monkeypatch, "release", recipe, "--quiet")
    report = json.loads((tmp_path / "out" / "release" / "report.json").read_text())
    names = [r["name"] for r in report["gates"]["results"]]
    assert names == [f"kld_mean_max[{d}]" for d in data.SUITE]
    assert code != 0 and [r["passed"] for r in report["gates"]["results"]] == [True] * 5 + [False]
    card = (tmp_path / "out" / "compressed-tensors" / "README.md").read_text()
    for d in data.SUITE:
        assert f"| {d} | " in card


def test_a_gate_for_a_domain_not_evaluated_is_a_recipe_error(tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "rtn: {bits: 4, group_size: 32}")
    recipe.write_text(recipe.read_text() + "release: {eval: {datasets: [wikitext2, code]}}\n"
                      "gates: {per_domain: {chat: {kld_mean_max: 0.1}}}\n")
    assert run_cli(monkeypatch, "release", recipe) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and ("gates.per_domain.chat: the domain is not evaluated (release.eval.datasets "
                                     "gives wikitext2, code)") in err


def test_token_ids_are_the_tokenizers_and_kept_per_tokenizer_and_text(tok):
    text = data.read_text(data.resolve("math", "eval", "x"))[:20000]
    first = data.token_ids(tok, text, add_special_tokens=False)
    assert first.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert data.token_ids(tiny_tokenizer(), text, add_special_tokens=False) is first  # an equal tokenizer: kept
    assert data.token_ids(tok, text + " x", add_special_tokens=False) is not first
    assert not torch.equal(data.token_ids(tiny_tokenizer(384), text, add_special_tokens=False), first)


def test_token_ids_come_back_from_the_disk_cache_in_a_new_process(tok, tmp_path, monkeypatch):
    """A quantize run tokenizes its calibration text once per machine: a later process reads the ids from
    $QUANTKIT_CACHE/tokens instead of tokenizing again (same ids), and a corrupt entry is tokenized again."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "_TOKENIZED", type(data._TOKENIZED)())  # a fresh process's memory
    text = data.read_text(data.resolve("code", "eval", "x"))[:30000]
    first = data.token_ids(tok, text)
    [entry] = (tmp_path / "tokens").glob("*.safetensors")
    data._TOKENIZED.clear()

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "_tokenize", refuse)
    again = data.token_ids(tok, text)
    assert torch.equal(again, first) and again.dtype == torch.int64
    data._TOKENIZED.clear()
    entry.write_bytes(b"not safetensors")
    monkeypatch.undo()
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    assert torch.equal(data.token_ids(tok, text), first)
