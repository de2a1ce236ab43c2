"""A throwaway test CA with a server and a client certificate, as PEM files (the `cryptography` library).

    ca = TestCA(tmp_path)                    # ca.pem
    server = ca.issue("server", dns=["redis.test"], ips=["127.0.0.1"])  # server.pem, server.key
    client = ca.issue("client", client=True)

`RedisTLS` starts a real redis-server with TLS only (`--port 0 --tls-port P`), on `RedisServer`'s temp dir,
SIGKILL on close and with the thread that started it; its readiness is checked over TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from modeldock.devstack.redis_sentinel import TLSFiles
from tests.support.redis_server import RedisServer

__all__ = ["Issued", "RedisTLS", "TestCA"]


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


class TestCA:
    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path, name: str = "modeldock test CA") -> None:
        self.dir = directory
        self._key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._name = subject
        self._cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name.replace(' ', '-')}.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, dns: Sequence[str] = (), ips: Sequence[str] = (), client: bool = False) -> Issued:
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                  else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        cert_path = self.dir / f"{name}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, _write_key(key, self.dir / f"{name}.key"))


class RedisTLS(RedisServer):
    """A redis-server that listens only over TLS (on `port`), with `server`'s certificate (the args of
    devstack's `TLSFiles`, as a TLS Sentinel topology's nodes); with `require_client_cert`, clients must
    present a certificate the CA signed (`tls-auth-clients yes`)."""

    def __init__(self, ca: TestCA, server: Issued, *, require_client_cert: bool = False,
                 extra_args: Sequence[str] = ()) -> None:
        super().__init__(tls_ca=ca.cert)
        self.ca = ca
        self._require = require_client_cert
        files = TLSFiles(ca.cert, server.cert, server.key)
        # A later option wins: the client certificate required or not, as asked.
        self.args = (*files.server_args(self.port), "--tls-auth-clients", "yes" if require_client_cert else "no",
                     *extra_args)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        if not self._require:
            return super()._answers()  # PING over TLS
        # A handshake without a client certificate is refused: up once the port accepts.
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False
