"""A throwaway PKI for the TLS tests, made with the openssl CLI (no extra Python package).

``make_pki(dir)`` writes a test CA, a server certificate for 127.0.0.1/localhost, a client
certificate whose key is encrypted with a password, and an unrelated "rogue" CA that must
never be trusted.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLIENT_KEY_PASSWORD = "KEYPASS-c3d4e5-secret"


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path  # encrypted with CLIENT_KEY_PASSWORD
    client_key_plain: Path
    rogue_ca_cert: Path


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    assert binary, "the openssl CLI is needed to make the test PKI"
    done = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


def _ca(cwd: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=cwd,
    )  # fmt: skip


def _leaf(cwd: Path, name: str, usage: str) -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=cwd,
    )  # fmt: skip
    ext = cwd / f"{name}.ext"
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name,
        cwd=cwd,
    )  # fmt: skip


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "rogue-ca")
    _leaf(directory, "server", "serverAuth")
    _leaf(directory, "client", "clientAuth")
    _openssl(
        "pkey", "-in", "client.key", "-out", "client-encrypted.key", "-aes256",
        "-passout", f"pass:{CLIENT_KEY_PASSWORD}",
        cwd=directory,
    )  # fmt: skip
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return Pki(
        dir=directory,
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client-encrypted.key",
        client_key_plain=directory / "client.key",
        rogue_ca_cert=directory / "rogue-ca.crt",
    )
