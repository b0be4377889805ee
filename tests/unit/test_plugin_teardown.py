"""What uninstall removes from a node: the plugin's own files, and nothing it did not make."""

from __future__ import annotations

from pathlib import Path

from dynamig.agent.plugin import cdi
from dynamig.agent.plugin.settings import PluginSettings
from dynamig.agent.plugin.teardown import remove_node_files


def test_only_what_the_plugin_made_is_removed(tmp_path: Path) -> None:
    s = PluginSettings(
        node_name="n", kubelet_root=tmp_path / "kubelet", cdi_root=tmp_path / "cdi", dev_root=tmp_path / "d"
    )
    ours = [cdi.spec_path(s.cdi_root, "uid-1"), cdi.spec_path(s.cdi_root, "uid-2"), s.checkpoint_path]
    made = s.dev_root / "nvidia-caps" / "nvidia-cap30"  # a capability node the plugin created
    theirs = [
        s.cdi_root / "nvidia.yaml",  # the toolkit's node spec
        s.dev_root / "nvidia-caps" / "nvidia-cap21",  # made by nvidia-modprobe, not by the plugin
        s.kubelet_root / "plugins" / "other.example.com" / "dra.sock",
    ]
    for path in [*ours, made, *theirs]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    cdi.record_created_nodes(s.device_node_ledger, [made])

    removed = remove_node_files(s)

    assert sorted(removed) == sorted([*ours, made, s.device_node_ledger])
    assert [p for p in [*ours, made, s.device_node_ledger] if p.exists()] == []
    assert all(p.exists() for p in theirs)
    assert not s.plugin_dir.exists(), "its empty directory goes too"
    assert remove_node_files(s) == [], "idempotent"
