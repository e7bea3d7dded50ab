from __future__ import annotations

from pathlib import Path

from sdcp.bench.streamed import fresh_cluster
from sdcp.cluster import LocalCluster


def test_a_cluster_left_by_an_earlier_run_is_removed_before_the_next(tmp_path: Path) -> None:
    # A second bench run into the same --out must not start on the first run's MLC (its prefix
    # cache and its history of answers to the very prompts it asks again).
    root = LocalCluster(tmp_path).root
    (root / "mlc" / "logs").mkdir(parents=True)
    (root / "mlc" / "index.sqlite").write_bytes(b"an earlier run's history")
    (root / "models").mkdir()

    cluster = fresh_cluster(tmp_path)

    assert cluster.root == root
    assert not root.exists()
    assert cluster.instances() == []


def test_a_home_without_a_cluster_is_left_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()

    fresh_cluster(tmp_path)

    assert (tmp_path / "models").is_dir()
