"""A local OCI registry for the release tests: CNCF distribution's ``registry`` (built from its Go module by
``hack/build-oci-tool.sh registry``) serving plain HTTP on the loopback address, its blobs in a work
directory. What a team's own registry is to an install: ``hack/publish.sh`` pushes to it, helm and the
node's containerd pull from it."""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import yaml

from dynamig.devcluster.processes import Component, free_port, stop_all, wait_for


class RegistryError(RuntimeError):
    pass


class ManifestGet(NamedTuple):
    reference: str  # a tag or a digest
    status: int
    user_agent: str


class LocalRegistry:
    """``registry serve`` on ``127.0.0.1:<free port>``; :attr:`host` is what image references name."""

    def __init__(self, binary: Path, work_dir: Path, *, start_timeout: float = 60.0) -> None:
        self.binary, self.work_dir, self._start_timeout = binary, work_dir, start_timeout
        self.host = f"127.0.0.1:{free_port()}"
        self._component: Component | None = None

    def start(self) -> LocalRegistry:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "config.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "version": 0.1,
                    "log": {"level": "info", "accesslog": {"disabled": False}},
                    "storage": {"filesystem": {"rootdirectory": str(self.work_dir / "data")}},
                    "http": {"addr": self.host},
                }
            )
        )
        self._component = Component.spawn(
            "registry",
            [str(self.binary), "serve", str(config)],
            log_path=self.work_dir / "registry.log",
            cwd=self.work_dir,
            # Tracing is on by default and would post to an OTLP collector nothing runs here.
            env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
        )
        wait_for(
            self._component,
            self._answers,
            deadline=time.monotonic() + self._start_timeout,
            what=f"the registry answering on {self.host}",
            fail=RegistryError,
        )
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as r:
                return int(r.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def manifest_gets(self, repository: str) -> list[ManifestGet]:
        """The manifest GETs of ``repository`` in the registry's access log (combined format), in order."""
        log = (self.work_dir / "registry.log").read_text(errors="replace")
        pattern = re.compile(
            rf'"GET /v2/{re.escape(repository)}/manifests/(\S+) HTTP/[\d.]+" (\d+) \S+ "[^"]*" "([^"]*)"'
        )
        return [ManifestGet(m[1], int(m[2]), m[3]) for m in pattern.finditer(log)]

    def stop(self) -> None:
        if self._component is not None:
            stop_all([self._component])
            self._component = None
