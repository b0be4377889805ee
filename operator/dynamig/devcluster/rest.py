"""A minimal synchronous HTTPS client for the local API server (standard library only).

The control plane needs a few calls before any event loop exists (readiness probes, registering nodes from a
sync fixture or the CLI), so it does not depend on the async client. Authentication is by client certificate.
"""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path
from typing import Any


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, body: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class RestClient:
    """JSON requests to ``https://host:port`` with a client certificate; the server is checked by ``ca``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ca: Path | None,
        cert: Path | None = None,
        key: Path | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        ctx = ssl.create_default_context(cafile=str(ca)) if ca else ssl._create_unverified_context()
        if cert and key:
            ctx.load_cert_chain(str(cert), str(key))
        self._ctx = ctx

    def raw(
        self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"
    ) -> tuple[int, str]:
        """One request; returns (status, body text). Raises ``OSError`` when the server cannot be reached."""
        conn = http.client.HTTPSConnection(self.host, self.port, context=self._ctx, timeout=self.timeout)
        try:
            headers = {"Accept": "application/json"}
            if body is not None:
                headers["Content-Type"] = content_type
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def request(
        self, method: str, path: str, obj: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        """Send ``obj`` as JSON and return the decoded JSON answer; raises :class:`ApiError` on non-2xx."""
        body = None if obj is None else json.dumps(obj).encode()
        status, text = self.raw(method, path, body, content_type)
        if not 200 <= status < 300:
            raise ApiError(status, text, method, path)
        decoded: dict[str, Any] = json.loads(text) if text else {}
        return decoded
