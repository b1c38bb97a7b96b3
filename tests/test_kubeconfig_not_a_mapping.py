"""A kubeconfig file whose YAML is no mapping is named as such, not with the loader's Python error."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.kube.client import KubeUnavailableError, kube_client


@pytest.mark.parametrize(("text", "kind"), [("just some garbage\n", "str"), ("- a\n- b\n", "list"), ("42\n", "int")])
def test_a_kubeconfig_that_is_no_mapping_says_so_naming_the_file(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(KubeUnavailableError) as caught:
        kube_client(str(path))
    message = str(caught.value)
    assert f"{path} is not a kubeconfig: its YAML is a {kind}" in message
    assert "item assignment" not in message


def test_a_kubeconfig_mapping_missing_its_context_keeps_the_loaders_reason(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\ncurrent-context: nowhere\ncontexts: []\n")
    with pytest.raises(KubeUnavailableError) as caught:
        kube_client(str(path))
    assert "is not a kubeconfig" not in str(caught.value)
    assert "nowhere" in str(caught.value)
