"""What the OpenAI-facing workloads share: a streamed chat request timed by its client, the default
`sdcp up` cluster started for a bench, percentiles."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from sdcp.bench.workloads import BenchInputError
from sdcp.cluster import LocalCluster
from sdcp.home import sdcp_home
from sdcp.latency import PARTS

__all__ = [
    "BENCH_MODEL",
    "ClusterRun",
    "Turn",
    "chat_request",
    "first_token_parts",
    "fresh_cluster",
    "metric_samples",
    "part_means_ms",
    "percentile",
    "start_default_cluster",
    "stream_chat",
]

BENCH_MODEL = "smollm2"
TURN_TIMEOUT_S = 600.0


@dataclass
class Turn:
    label: str
    first_token_ms: float | None
    seconds: float
    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def chat_request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    """POST ``body`` to the OpenAI endpoint ``url``'s chat completions."""
    return urllib.request.Request(
        f"{url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> Turn:
    """POST a streamed greedy chat completion and read it to its end, timed by the client."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = chat_request(url, body)
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=TURN_TIMEOUT_S) as response:  # noqa: S310 - loopback
        for line in response:
            data = line.removeprefix(b"data: ").strip()
            if not data or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = 1000 * (time.perf_counter() - started)
                    pieces.append(text)
            usage = chunk.get("usage") or usage
    seconds = time.perf_counter() - started
    return Turn("", first, seconds, "".join(pieces), usage.get("prompt_tokens"), usage.get("completion_tokens"))


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


@dataclass(frozen=True)
class ClusterRun:
    cluster: LocalCluster
    gateway: str
    verifier_metrics: str


def fresh_cluster(home: Path) -> LocalCluster:
    """The cluster under ``home`` (a directory of the bench's --out), stopped and removed if an
    earlier run left one: a run into the same --out would otherwise start on that run's MLC, whose
    prefix cache and history of answers hold the very prompts it asks again."""
    cluster = LocalCluster(home)
    cluster.down()
    shutil.rmtree(cluster.root, ignore_errors=True)
    return cluster


def start_default_cluster(
    home: Path, role_settings: dict[str, dict[str, Any]] | None = None, *, one_process: bool | None = None
) -> ClusterRun:
    """`sdcp up` under ``home`` on the bundled model (the fetched one, linked), gateway on a free port
    (``one_process``: `sdcp up --one-process` or `--processes`; None: its default), nothing kept of
    an earlier run (fresh_cluster).
    The caller takes the cluster down."""
    home.mkdir(parents=True, exist_ok=True)
    models = home / "models"
    if not models.exists():
        models.symlink_to((sdcp_home() / "models").resolve(), target_is_directory=True)
    cluster = fresh_cluster(home)
    try:
        cluster.up(model=BENCH_MODEL, gateway_port=0, role_settings=role_settings, one_process=one_process)
        gateway = cluster.gateway
        verifier = next(instance for instance in cluster.instances() if instance.role == "verifier")
        if gateway is None or verifier.admin is None:
            raise BenchInputError(f"the cluster under {home} has no gateway or no verifier admin listener")
    except BaseException:
        cluster.down()
        raise
    return ClusterRun(cluster, gateway, f"{verifier.admin}/metrics")


def metric_samples(metrics_url: str) -> list[Sample]:
    """Every sample of a Prometheus /metrics page."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def first_token_parts(cluster: LocalCluster) -> dict[str, tuple[float, float]]:
    """Every instance's first-token latency parts so far (sdcp.latency): part -> (seconds, count)."""
    totals: dict[str, list[float]] = {}
    # A process's metrics once: in one process every admin listener serves every instance's series.
    admins = {instance.pid: instance.admin for instance in cluster.instances() if instance.admin is not None}
    for admin in admins.values():
        for sample in metric_samples(f"{admin}/metrics"):
            for suffix, index in (("_sum", 0), ("_count", 1)):
                if sample.name == f"sdcp_first_token_part_seconds{suffix}":
                    totals.setdefault(sample.labels["part"], [0.0, 0.0])[index] += sample.value
    return {part: (seconds, count) for part, (seconds, count) in totals.items()}


def part_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The mean of each part (ms) over the requests between two readings, in the order of PARTS."""
    means = {}
    for part in PARTS:
        seconds = after.get(part, (0.0, 0.0))[0] - before.get(part, (0.0, 0.0))[0]
        count = after.get(part, (0.0, 0.0))[1] - before.get(part, (0.0, 0.0))[1]
        if count > 0:
            means[part] = 1000 * seconds / count
    return means
