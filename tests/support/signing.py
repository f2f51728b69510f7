"""Keys and self-signed certificates for Celery's message signing, made in the test (the
``cryptography`` package), and a producer that publishes with one of them."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from tests.support.cluster import REPO


@dataclass(frozen=True)
class Signer:
    key: Path
    certificate: Path

    def env(self, store: Path) -> dict[str, str]:
        """The settings a Charlie process signs with this key and accepts ``store``'s certs by."""
        return {
            "CHARLIE_SECURITY_KEY": str(self.key),
            "CHARLIE_SECURITY_CERTIFICATE": str(self.certificate),
            "CHARLIE_SECURITY_CERT_STORE": str(store),
        }


def make_signer(folder: Path, name: str) -> Signer:
    """An RSA key (Celery's auth serializer signs with RSA) and a self-signed certificate valid
    from a day ago to a day from now."""
    folder.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"charlie-test-{name}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    key_path = folder / f"{name}.key"
    cert_path = folder / f"{name}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Signer(key_path, cert_path)


def cert_store(folder: Path, *signers: Signer) -> Path:
    """A directory holding these signers' certificates: whose signatures are accepted."""
    folder.mkdir(parents=True, exist_ok=True)
    for signer in signers:
        (folder / signer.certificate.name).write_bytes(signer.certificate.read_bytes())
    return folder


#: publish one task by name through Charlie's app, configured by the environment (signed when
#: CHARLIE_SECURITY_* are set), in a process of its own: Celery's signing set-up is global to
#: a process, and the test process itself publishes unsigned.
_PUBLISH = """
import json, sys
from charlie.app import app
name, args, kwargs, task_id = json.loads(sys.argv[1])
app.send_task(name, args=args, kwargs=kwargs, task_id=task_id)
print(app.conf.task_serializer)
"""


def publish(
    env: dict[str, str], name: str, args: list[Any], kwargs: dict[str, Any], task_id: str
) -> str:
    """Publish a task message from a separate producer process with ``env``; returns the
    serializer it used (``auth``: signed)."""
    done = subprocess.run(
        [sys.executable, "-c", _PUBLISH, json.dumps([name, args, kwargs, task_id])],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()
