"""The ``--metrics-tls-*`` and ``--metrics-authorize`` flags that ``dynamig agent`` and ``dynamig operator``
share: ``/metrics`` over TLS, for bearer tokens the API server allows to ``get /metrics``
(dynamig.kube.metricsauth)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dynamig.cli.errors import EXIT_USAGE, CommandError


def add_metrics_security_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-tls-cert-file",
        type=Path,
        default=None,
        help="serve /metrics over TLS with this PEM certificate (chain first; read again when it changes)",
    )
    p.add_argument("--metrics-tls-key-file", type=Path, default=None, help="its PEM private key")
    p.add_argument(
        "--metrics-authorize",
        action="store_true",
        help="answer /metrics only to bearer tokens the API server allows to get /metrics (TokenReview and "
        "SubjectAccessReview, as kube-rbac-proxy does; needs the TLS flags and the right to create both)",
    )


def metrics_tls_files(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """The certificate and key, or None for plain HTTP; CommandError (usage) for half a pair, or for
    --metrics-authorize without TLS (a bearer token never travels in the clear)."""
    cert, key = args.metrics_tls_cert_file, args.metrics_tls_key_file
    if (cert is None) != (key is None):
        raise CommandError("--metrics-tls-cert-file and --metrics-tls-key-file go together", EXIT_USAGE)
    if args.metrics_authorize and cert is None:
        raise CommandError(
            "--metrics-authorize needs --metrics-tls-cert-file and --metrics-tls-key-file: scrapers' bearer "
            "tokens must not travel in the clear",
            EXIT_USAGE,
        )
    return None if cert is None else (cert, key)
