"""Certificates and keys for the local control plane, made with ``cryptography``.

One throw-away certificate authority signs the API server's serving certificate and a client certificate
per identity (admin, scheduler, controller manager); a separate key pair signs service-account tokens.
ECDSA P-256 keys are used throughout because generating them takes microseconds, which keeps start-up fast.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class CertPair:
    """Paths of a PEM certificate and its PEM private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPki:
    """Every credential file the control plane needs, all under one directory."""

    ca: CertPair
    apiserver: CertPair
    admin: CertPair
    scheduler: CertPair
    controller_manager: CertPair
    service_account_key: Path  # private key: signs tokens
    service_account_pub: Path  # public key: verifies tokens


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, *, private: bool) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _issue(
    *,
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    is_ca: bool,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=not is_ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def generate_pki(directory: Path, *, service_ip: str = "10.0.0.1") -> ClusterPki:
    """Create a fresh CA, serving and client certificates and service-account keys under ``directory``.

    Side effects: writes PEM files (private keys mode 0600) into ``directory``, which must exist.
    """
    ca_key = _new_key()
    ca_name = _name("dynamig-dev-ca")
    ca_cert = _issue(
        subject=ca_name, key=ca_key, issuer=ca_name, issuer_key=ca_key, is_ca=True, usages=[], sans=[]
    )

    def leaf(
        stem: str, subject: x509.Name, usages: list[x509.ObjectIdentifier], sans: list[x509.GeneralName]
    ) -> CertPair:
        key = _new_key()
        cert = _issue(
            subject=subject, key=key, issuer=ca_name, issuer_key=ca_key, is_ca=False, usages=usages, sans=sans
        )
        pair = CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
        _write(pair.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(pair.key, _key_pem(key), private=True)
        return pair

    ca = CertPair(cert=directory / "ca.crt", key=directory / "ca.key")
    _write(ca.cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(ca.key, _key_pem(ca_key), private=True)

    server_sans: list[x509.GeneralName] = [
        x509.DNSName(n)
        for n in (
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        )
    ]
    server_sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip)]
    client = [ExtendedKeyUsageOID.CLIENT_AUTH]
    apiserver = leaf("apiserver", _name("kube-apiserver"), [ExtendedKeyUsageOID.SERVER_AUTH], server_sans)
    # Kubernetes reads the user from CN and the groups from O.
    admin = leaf("admin", _name("dynamig-admin", "system:masters"), client, [])
    scheduler = leaf("scheduler", _name("system:kube-scheduler"), client, [])
    controller_manager = leaf("controller-manager", _name("system:kube-controller-manager"), client, [])

    sa_key = _new_key()
    sa_priv = directory / "sa.key"
    sa_pub = directory / "sa.pub"
    _write(sa_priv, _key_pem(sa_key), private=True)
    _write(
        sa_pub,
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        private=False,
    )
    return ClusterPki(
        ca=ca,
        apiserver=apiserver,
        admin=admin,
        scheduler=scheduler,
        controller_manager=controller_manager,
        service_account_key=sa_priv,
        service_account_pub=sa_pub,
    )


def issue_client_cert(pki: ClusterPki, directory: Path, stem: str, user: str, group: str | None) -> CertPair:
    """A client certificate for ``user`` (CN) in ``group`` (O), signed by the cluster CA; for a kubelet,
    ``system:node:<name>`` in ``system:nodes``, which the Node authorizer and NodeRestriction know.
    Side effects: writes ``<stem>.crt`` and ``<stem>.key`` (0600) into ``directory``, which must exist."""
    ca_key = serialization.load_pem_private_key(pki.ca.key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca.key} is not an EC key")
    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
    key = _new_key()
    cert = _issue(
        subject=_name(user, group),
        key=key,
        issuer=ca_cert.subject,
        issuer_key=ca_key,
        is_ca=False,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=[],
    )
    pair = CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    _write(pair.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(pair.key, _key_pem(key), private=True)
    return pair
