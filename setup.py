"""Build hook: every build (wheel, sdist install, editable) generates the kubelet gRPC stubs first.

pyproject.toml holds the project's metadata; this file only adds a ``build_py`` step that runs
``operator/dynamig/agent/plugin/build_protos.py`` (grpcio-tools, a build requirement) so the wheel carries
``dynamig.agent.plugin._generated`` without ``make proto``. The generator writes into the source tree, as
``make proto`` does (the directory is git-ignored), and is a no-op when its stamp matches; an editable
install imports the modules from there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import SetupError

GENERATOR = Path(__file__).resolve().parent / "operator/dynamig/agent/plugin/build_protos.py"
GENERATED_PACKAGE = "dynamig.agent.plugin._generated"


def _generator() -> ModuleType:
    # Loaded from its file: the package and its runtime dependencies are not importable while it builds.
    spec = importlib.util.spec_from_file_location("dynamig_build_protos", GENERATOR)
    if spec is None or spec.loader is None:
        raise SetupError(f"cannot load the stub generator {GENERATOR}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        try:
            _generator().build()
        except SystemExit as exc:  # the generator's own "grpcio-tools is missing" and protoc failures
            raise SetupError(f"generating the kubelet gRPC stubs failed: {exc}") from exc
        # Package discovery ran before the stubs existed on a fresh checkout: add their package.
        if self.packages is not None and GENERATED_PACKAGE not in self.packages:
            self.packages.append(GENERATED_PACKAGE)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
