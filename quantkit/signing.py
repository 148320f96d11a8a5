"""`quantkit sign` and verify's signature check, through OpenSSF model-signing: a Sigstore bundle (DSSE envelope over
an in-toto statement of every file's sha256) that `model_signing verify key|certificate` checks the same way.

Offline modes only: an elliptic-curve private key (checked with its public key), or that key with its signing
certificate and chain (checked against a certificate chain the verifier trusts). Keyless Sigstore signing needs an
OIDC login and the public transparency log, so it is not offered.

The signature goes to ARTIFACT/model.sig unless told otherwise: `model.sig` is model-signing's CLI default name, and
inside the folder it travels with the artifact (a hub upload, a copy); model-signing leaves the signature file out
of what it signs, as its CLI does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .errors import QuantkitError, first_line

SIGNATURE_NAME = "model.sig"


def signature_path(folder: Path, given: str | Path | None) -> Path:
    return Path(given) if given else folder / SIGNATURE_NAME


def _hashing(folder: Path, signature: Path):
    """model-signing's default hashing (sha256 per file, git files left out), the signature file left out too."""
    from model_signing import hashing

    try:
        inside = [signature.resolve().relative_to(folder.resolve())]
    except ValueError:  # a signature outside the folder is no file of the model
        inside = []
    return hashing.Config().set_ignored_paths(paths=inside)


def _check_pem(path: str | Path, option: str, public: bool) -> None:
    """One line naming the option for a key model-signing cannot use; its own errors would not say which file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        data = Path(path).read_bytes()
        key = (serialization.load_pem_public_key(data) if public
               else serialization.load_pem_private_key(data, password=None))
    except OSError as err:
        raise QuantkitError(f"{option}: cannot read {path}: {err.strerror or err}") from None
    except (ValueError, TypeError) as err:  # not PEM, or encrypted (a password is not taken)
        what = "a PEM public key" if public else "an unencrypted PEM private key"
        raise QuantkitError(f"{option}: {path}: not {what} ({first_line(err)})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey):
        raise QuantkitError(f"{option}: {path}: not an elliptic-curve key (model-signing signs with P-256/384/521)")


def check_key(key: str | Path, option: str = "--key") -> None:
    """Fails now, with one line, on a key that `sign` could not use (release checks before minutes of work)."""
    _check_pem(key, option, public=False)


def sign(folder: Path, key: str | Path, signature: str | Path | None = None, certificate: str | Path | None = None,
         chain: Sequence[str | Path] = ()) -> Path:
    """Signs every file of `folder`; callers sign only what passes `quantkit verify` (verify.sign_verified)."""
    from model_signing import signing

    check_key(key)
    out = signature_path(folder, signature)
    config = signing.Config().set_hashing_config(_hashing(folder, out))
    if certificate:
        _readable([certificate], "--certificate")
        _readable(chain, "--certificate-chain")
        try:
            config.use_certificate_signer(private_key=key, signing_certificate=certificate, certificate_chain=chain)
        except ValueError as err:  # no PEM certificates, or the certificate does not hold the key's public half
            raise QuantkitError(f"--certificate, --certificate-chain: {first_line(err)}") from None
    else:
        config.use_elliptic_key_signer(private_key=key)
    try:
        config.sign(folder, out)
    except OSError as err:
        raise QuantkitError(f"--signature: cannot write {out}: {err.strerror or err}") from None
    return out


def _readable(paths: Sequence[str | Path], option: str) -> None:
    for p in paths:
        if not Path(p).is_file():
            raise QuantkitError(f"{option}: cannot read {p}")


def check(folder: Path, signature: Path, public_key: str | Path | None,
          certificate_chain: Sequence[str | Path] = ()) -> tuple[bool, str]:
    """(ok, detail) of the signature at `signature` over `folder`, checked with the public key or the chain."""
    from model_signing import verifying

    if not signature.is_file():
        return False, f"{signature.name}: missing (the artifact is unsigned)"
    config = verifying.Config().set_hashing_config(_hashing(folder, signature))
    if certificate_chain:
        _readable(certificate_chain, "--certificate-chain")
        try:
            config.use_certificate_verifier(certificate_chain=[Path(c) for c in certificate_chain])
        except ValueError as err:
            raise QuantkitError(f"--certificate-chain: not PEM certificates ({first_line(err)})") from None
        how = "certificate chain"
    else:
        _check_pem(public_key, "--public-key", public=True)
        config.use_elliptic_key_verifier(public_key=public_key)
        how = f"public key {Path(public_key).name}"
    try:
        config.verify(folder, signature)
    # model-signing raises ValueError for a mismatch, and whatever its parsers and OpenSSL raise for a malformed
    # bundle or a chain that does not verify: every one is this check's finding
    except Exception as err:
        return False, f"{signature.name}: {_mismatch(str(err))}"
    return True, f"{signature.name}: every file matches, signed by the {how}"


def _mismatch(message: str) -> str:
    """model-signing's 'Signature mismatch: [...]' (a list's repr, digest reprs inside) as the files it names. A
    digest holding a double quote makes its item's repr escape the single quotes: unescaped first."""
    message = message.replace("\\'", "'")
    changed = re.findall(r"Hash mismatch for '([^']+)'", message)
    extra = re.findall(r"Extra files found in model '[^']*': ([^\"'\]]+)", message)
    missing = re.findall(r"Missing files in model '[^']*': ([^\"'\]]+)", message)
    if not (changed or extra or missing):
        return f"does not verify ({first_line(message)[:300]})"
    parts = ([f"{', '.join(changed)} changed since signing"] if changed else []) + \
        ([f"{', '.join(extra)} not signed"] if extra else []) + ([f"{', '.join(missing)} missing"] if missing else [])
    return "; ".join(parts)
