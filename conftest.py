"""Repository-wide pytest configuration: one shared control plane for ``tests/`` and ``e2e/``.

The fixtures (``control_plane``, ``kube_api``, ``namespace``, ``make_node``) live in
``dynamig.devcluster.pytest_plugin``; registering the plugin here, at the root, makes a single session-scoped
control plane serve both test trees.
"""

pytest_plugins = ["dynamig.devcluster.pytest_plugin"]
