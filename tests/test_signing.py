"""`quantkit sign` / `verify --public-key`: a manifest beside the files vouches for nothing an editor can re-hash.
Each tampering below re-hashes quantkit.json as an attacker would; the signature catches every one (exit 1, the
file named), and what a manifest cannot vouch for (packed dtypes, shards, code, an empty list) fails unsigned too."""

from __future__ import annotations

import datetime
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from safetensors.torch import load_file, save_file

from conftest import run_cli, write_recipe
from quantkit.export.artifact import INDEX_NAME, sha256_file
from test_verify import verify

# ~30 KB shards: every artifact here is sharded, so the index and its shards are part of what is tampered with
SHARDS = ", max_shard_size: 30KB"


@pytest.fixture(scope="module")
def artifacts(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("signing")
    recipe = write_recipe(out / "r.yaml", tiny_llama, out / "q", "rtn: {bits: 4, group_size: 32}", extra=SHARDS)
    mp = pytest.MonkeyPatch()
    assert run_cli(mp, "quantize", recipe, "--quiet") == 0
    mp.undo()
    assert (out / "q" / "gptq" / INDEX_NAME).is_file()
    return out / "q"


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    path.with_suffix(".pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path.with_suffix(".pem"), path.with_suffix(".pub")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """(private, public) of the signer, and another key pair's public key."""
    root = tmp_path_factory.mktemp("keys")
    private, public = write_key(root / "signer", ec.generate_private_key(ec.SECP256R1()))
    _, other = write_key(root / "other", ec.generate_private_key(ec.SECP256R1()))
    return private, public, other


@pytest.fixture
def signed(artifacts, keys, tmp_path, monkeypatch, capsys):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    assert run_cli(monkeypatch, "sign", folder, "--key", keys[0]) == 0
    assert capsys.readouterr().out == f"sign: {folder} signed (key); signature {folder / 'model.sig'}\n"
    return folder


def rehash(folder: Path, files: dict | None = None) -> None:
    """quantkit.json's `files` written anew from what is there now (or `files`), as an editor would."""
    manifest = json.loads((folder / "quantkit.json").read_text())
    manifest["files"] = files if files is not None else {
        p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.name not in ("quantkit.json", "model.sig")}
    (folder / "quantkit.json").write_text(json.dumps(manifest))


def shard_of(folder: Path, tensor: str) -> Path:
    return folder / json.loads((folder / INDEX_NAME).read_text())["weight_map"][tensor]


QWEIGHT = "model.layers.0.self_attn.q_proj.qweight"


def scales_to_1000(folder: Path) -> str:
    name = "model.layers.0.self_attn.q_proj.scales"
    path = shard_of(folder, name)
    tensors = load_file(path)
    tensors[name] = torch.full_like(tensors[name], 1000)
    save_file(tensors, path, {"format": "pt"})
    return path.name


def flip_a_qweight_byte(folder: Path) -> str:
    path = shard_of(folder, QWEIGHT)
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + json.loads(data[8:8 + n])[QWEIGHT]["data_offsets"][0]
    data[start + 3] ^= 0x10
    path.write_bytes(bytes(data))
    return path.name


def qweight_header_to_f32(folder: Path) -> str:
    """The same bytes read as float32: same length, so the header stays valid (and the padding keeps its size)."""
    path = shard_of(folder, QWEIGHT)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[QWEIGHT]["dtype"] = "F32"
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])
    return path.name


def drop_the_index(folder: Path) -> str:
    (folder / INDEX_NAME).unlink()
    return INDEX_NAME


def add_code(folder: Path) -> str:
    (folder / "evil.py").write_text("open('/tmp/pwned', 'w')\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return "evil.py"


def empty_manifest(folder: Path) -> str:
    rehash(folder, {})
    return "quantkit.json"


# (tampering, the file the signature names, the check that fails without a signature, or None: only a signature
# can tell these values from the ones written)
TAMPERING = [
    (scales_to_1000, None, None),
    (flip_a_qweight_byte, None, None),
    (qweight_header_to_f32, None, f"FAIL  layout       {QWEIGHT}: float32 [8, 64]; gptq stores int32 [8, 64]"),
    (drop_the_index, INDEX_NAME, f"FAIL  manifest     {INDEX_NAME}: missing, and loaders read "),
    (add_code, "evil.py", "FAIL  code         evil.py: executable code (.py file); config.json: auto_map points"),
    (empty_manifest, "quantkit.json", "FAIL  manifest     quantkit.json: lists no files"),
]


@pytest.mark.parametrize("tamper, named, unsigned", TAMPERING, ids=[t[0].__name__ for t in TAMPERING])
def test_a_rehashed_edit_fails_the_signature(signed, keys, monkeypatch, capsys, tamper, named, unsigned):
    changed = tamper(signed)
    if changed != "quantkit.json":
        rehash(signed)
    code, lines, _ = verify(monkeypatch, capsys, signed, "--public-key", keys[1])
    assert code == 1
    sig = lines[0]
    assert sig.startswith("FAIL  signature    model.sig: ") and (named or changed) in sig, sig
    assert "changed since signing" in sig or "not signed" in sig or "missing" in sig, sig
    assert lines[-1].startswith(f"verify: {signed} FAILED: model.sig: "), lines[-1]
    if unsigned:  # what the manifest cannot vouch for is caught with no key at all
        code, lines, _ = verify(monkeypatch, capsys, signed)
        assert code == 1 and lines[0].startswith("ok    signature    model.sig: signed, not checked"), lines[0]
        assert any(line.startswith(unsigned) for line in lines), lines


def test_mismatch_names_the_files_however_the_digests_are_quoted():
    from quantkit.signing import _mismatch

    digest = "Digest(algorithm='sha256', digest_value=b'\\x01\"')"  # a byte that is a double quote
    items = [f"Hash mismatch for 'quantkit.json': Expected '{digest}', Actual '{digest}'",
             "Extra files found in model 'gptq': evil.py, x.py", "Missing files in model 'gptq': a.json"]
    assert "\\'quantkit.json\\'" in repr(items)  # the escaped form model-signing's message then has
    assert _mismatch(f"Signature mismatch: {items}") == \
        "quantkit.json changed since signing; evil.py, x.py not signed; a.json missing"


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_sign_and_verify_round_trip(artifacts, keys, tmp_path, monkeypatch, capsys, fmt):
    import model_signing

    folder = shutil.copytree(artifacts / fmt, tmp_path / fmt)
    assert run_cli(monkeypatch, "sign", folder, "--key", keys[0]) == 0
    code, lines, err = verify(monkeypatch, capsys, folder, "--public-key", keys[1])
    assert code == 0 and err == "", (lines, err)  # model.sig is no unlisted file
    assert lines[0] == f"ok    signature    model.sig: every file matches, signed by the public key {keys[1].name}"
    assert lines[-1].endswith(", signature ok)")
    # model-signing's own verifier takes quantkit's signature: nothing quantkit-specific in it
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=keys[1]).verify(folder, folder / "model.sig")
    code, lines, _ = verify(monkeypatch, capsys, folder, "--quiet")  # signed, without a key: said, not failed
    assert code == 0 and lines[-1].endswith(", signature not checked)")
    # a signature kept outside the folder
    outside = tmp_path / "elsewhere.sig"
    (folder / "model.sig").unlink()
    assert run_cli(monkeypatch, "sign", folder, "--key", keys[0], "--signature", outside) == 0
    assert not (folder / "model.sig").exists()
    code, lines, _ = verify(monkeypatch, capsys, folder, "--signature", outside, "--public-key", keys[1], "--quiet")
    assert code == 0 and lines[-1].endswith(", signature ok)"), lines


def test_a_wrong_public_key_or_no_signature_fails(signed, artifacts, keys, tmp_path, monkeypatch, capsys):
    code, lines, _ = verify(monkeypatch, capsys, signed, "--public-key", keys[2])
    assert code == 1 and lines[0].startswith("FAIL  signature    model.sig: does not verify (Key mismatch"), lines[0]
    unsigned = shutil.copytree(artifacts / "gptq", tmp_path / "unsigned")
    code, lines, _ = verify(monkeypatch, capsys, unsigned, "--quiet")  # unsigned, none asked for: said, not failed
    assert code == 0 and lines[-1].endswith(", unsigned)")
    code, lines, _ = verify(monkeypatch, capsys, unsigned, "--public-key", keys[1], "--quiet")  # asked for
    assert code == 1 and lines == [f"verify: {unsigned} FAILED: model.sig: missing (the artifact is unsigned)"]


def test_a_shard_the_index_needs_is_missing(artifacts, monkeypatch, capsys, tmp_path):
    folder = shutil.copytree(artifacts / "compressed-tensors", tmp_path / "ct")
    gone = shard_of(folder, "model.layers.1.mlp.down_proj.weight_packed")
    gone.unlink()
    rehash(folder)
    code, lines, _ = verify(monkeypatch, capsys, folder)
    assert code == 1
    assert f"FAIL  manifest     {INDEX_NAME}: names {gone.name}, which is missing" in lines, lines


def test_an_unlisted_index_is_an_error(artifacts, monkeypatch, capsys, tmp_path):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    files = json.loads((folder / "quantkit.json").read_text())["files"]
    del files[INDEX_NAME]
    rehash(folder, files)
    code, lines, _ = verify(monkeypatch, capsys, folder, "--quiet")
    assert code == 1 and lines == [f"verify: {folder} FAILED: {INDEX_NAME}: present but not listed in quantkit.json"]


@pytest.mark.parametrize("code_in", ["py", "auto_map"])
def test_code_is_an_error_not_a_warning(artifacts, monkeypatch, capsys, tmp_path, code_in):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    if code_in == "py":
        (folder / "modeling_evil.py").write_text("import os\n")  # unlisted, as before: now an error
        want = "modeling_evil.py: executable code (.py file)"
    else:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg | {"auto_map": {"AutoTokenizer": ["t.T", None]}}))
        rehash(folder)
        want = "tokenizer_config.json: auto_map points loaders at code"
    code, lines, err = verify(monkeypatch, capsys, folder)
    assert code == 1 and f"FAIL  code         {want}" in "\n".join(lines), lines
    assert not any(line.startswith("ok    forward") or "FAIL  forward" in line for line in lines)  # never loaded
    assert "modeling_evil.py" not in err  # an error, not also a warning


def test_a_manifest_naming_a_file_outside_fails(artifacts, monkeypatch, capsys, tmp_path):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    (tmp_path / "secret").write_text("x")
    files = json.loads((folder / "quantkit.json").read_text())["files"]
    rehash(folder, files | {"../secret": sha256_file(tmp_path / "secret")})
    code, lines, _ = verify(monkeypatch, capsys, folder, "--quiet")
    assert code == 1 and lines == [f"verify: {folder} FAILED: quantkit.json: '../secret' is not a file name inside "
                                   "the artifact"]


def test_a_symlinked_file_fails(artifacts, monkeypatch, capsys, tmp_path):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    shutil.move(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    (folder / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")  # same bytes, so its sha256 still matches
    code, lines, _ = verify(monkeypatch, capsys, folder)
    assert code == 1 and "ok    sha256       tokenizer.json: sha256 ok" in lines
    assert "FAIL  manifest     tokenizer.json: a symbolic link (an artifact holds plain files)" in lines, lines


def test_usage_errors_are_one_line(signed, keys, tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.pem").write_text("not a key")
    capsys.readouterr()
    assert run_cli(monkeypatch, "sign", signed, "--key", tmp_path / "bad.pem") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --key: {tmp_path / 'bad.pem'}: not an unencrypted PEM private key (") and \
        err.count("\n") == 1
    assert run_cli(monkeypatch, "verify", signed, "--public-key", keys[0]) == 2  # the private half
    assert capsys.readouterr().err.startswith(f"error: --public-key: {keys[0]}: not a PEM public key (")
    assert run_cli(monkeypatch, "verify", signed, "--public-key", tmp_path / "nope.pub") == 2
    assert capsys.readouterr().err == f"error: --public-key: cannot read {tmp_path / 'nope.pub'}: No such file or " \
                                      "directory\n"
    assert run_cli(monkeypatch, "verify", signed, "--signature", signed / "model.sig") == 2
    assert capsys.readouterr().err == "error: --signature: checking it needs --public-key or --certificate-chain\n"


def test_sign_refuses_an_artifact_that_fails_verify(artifacts, keys, tmp_path, monkeypatch, capsys):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    add_code(folder)
    rehash(folder)
    capsys.readouterr()
    assert run_cli(monkeypatch, "sign", folder, "--key", keys[0]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: ARTIFACT: {folder} fails verify, not signed: evil.py: executable code") and \
        err.count("\n") == 1
    assert not (folder / "model.sig").exists()


def certificate(subject: str, key, issuer_cert=None, issuer_key=None, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer_cert.subject if issuer_cert else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                                            crl_sign=ca, encipher_only=False, decipher_only=False), critical=True))
    return builder.sign(issuer_key or key, hashes.SHA256())


def test_certificate_mode(artifacts, tmp_path, monkeypatch, capsys):
    pem = serialization.Encoding.PEM
    ca_key, rogue_key, leaf_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = certificate("quantkit test CA", ca_key, ca=True)
    rogue = certificate("another CA", rogue_key, ca=True)
    private, _ = write_key(tmp_path / "leaf", leaf_key)
    (tmp_path / "leaf.crt").write_bytes(certificate("release signer", leaf_key, ca, ca_key).public_bytes(pem))
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(pem))
    (tmp_path / "rogue.crt").write_bytes(rogue.public_bytes(pem))
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    capsys.readouterr()
    assert run_cli(monkeypatch, "sign", folder, "--key", private, "--certificate", tmp_path / "leaf.crt") == 2
    assert "certificate signing takes both" in capsys.readouterr().err
    assert run_cli(monkeypatch, "sign", folder, "--key", private, "--certificate", tmp_path / "leaf.crt",
                   "--certificate-chain", tmp_path / "ca.crt") == 0
    code, lines, _ = verify(monkeypatch, capsys, folder, "--certificate-chain", tmp_path / "ca.crt")
    assert code == 0 and lines[0] == "ok    signature    model.sig: every file matches, signed by the certificate chain"
    code, lines, _ = verify(monkeypatch, capsys, folder, "--certificate-chain", tmp_path / "rogue.crt")
    assert code == 1 and lines[0].startswith("FAIL  signature    model.sig: does not verify ("), lines[0]
    code, _, err = verify(monkeypatch, capsys, folder, "--certificate-chain", tmp_path / "leaf.pem")
    assert code == 2 and err.startswith("error: --certificate-chain: not PEM certificates (") and err.count("\n") == 1


# every layout quantkit writes passes the layout checks: (model, stage, formats)
VARIANTS = {
    "gptq-3bit-asym-act-order": ("llama", "gptq: {bits: 3, group_size: 32, sym: false, act_order: true}", ("gptq",)),
    "rtn-4bit-asym": ("llama", "rtn: {bits: 4, group_size: 64, sym: false}", ("gptq", "compressed-tensors")),
    "rtn-8bit-channel": ("llama", "rtn: {bits: 8, group_size: -1}", ("gptq", "compressed-tensors")),
    "awq-asym": ("llama", "awq: {group_size: 32, zero_point: true, grid: 4, clip: false}", ("awq",)),
    "w8a8-int8": ("llama", "rtn: {bits: 8, group_size: -1, activations: {type: int}}", ("compressed-tensors",)),
    "w8a8-fp8": ("llama", "rtn: {type: float, bits: 8, group_size: -1, activations: {type: float}}",
                 ("compressed-tensors",)),
    "opt-biases": ("opt", "rtn: {bits: 4, group_size: 32}", ("gptq", "awq")),
    # per-expert Linears under the original checkpoint's names (Mixtral: block_sparse_moe.experts.E.w1)
    "qwen3-moe": ("qwen3_moe", "rtn: {bits: 4, group_size: 32}", ("gptq", "compressed-tensors")),
    "mixtral": ("mixtral", "rtn: {bits: 4, group_size: 32}", ("gptq", "compressed-tensors")),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_layout_quantkit_writes_verifies(tiny_factory, tmp_path, monkeypatch, capsys, variant):
    arch, stage, formats = VARIANTS[variant]
    recipe = write_recipe(tmp_path / "r.yaml", tiny_factory(arch), tmp_path / "q", stage, formats=formats)
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    for fmt in formats:
        code, lines, _ = verify(monkeypatch, capsys, tmp_path / "q" / fmt)
        assert code == 0, (fmt, lines)
        assert any(line.startswith("ok    layout       ") and "quantized modules store the" in line
                   for line in lines), lines
