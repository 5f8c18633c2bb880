"""kvtier's ``/metrics`` read by a real Prometheus parser, and its vLLM metrics as vLLM writes them.

``kvtier serve`` runs with one tier of every type kvtier has (nvme, fs, memory), so the scrape
holds every series the manager and the tiers export. Two checks:

* the scrape, parsed by ``prometheus_client``'s text parser (the library vLLM 0.33.0 exports its
  metrics with), puts every sample under the family and type its ``# TYPE`` line declares:
  nothing falls out as an untyped family, histograms are whole (cumulative buckets ending in
  ``+Inf``, ``_count`` equal to it, a ``_sum``);
* every metric vLLM's own ``TieringOffloadingSpec`` declares that kvtier exports is created
  exactly as vLLM's ``OffloadPromMetrics`` creates it (its ``_create_metric``, on a fresh
  registry, without the per-engine labels a kvtier process has no use for), given the values
  kvtier reported, and written with ``prometheus_client.generate_latest``: kvtier's text for
  that family must be the same, byte for byte.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import signal
import subprocess
import types
import urllib.request
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

KVTIER_BIN = os.environ.get("KVTIER_BIN")

pytestmark = pytest.mark.skipif(
    not KVTIER_BIN, reason="KVTIER_BIN (the kvtier CLI) is not set; run through cargo test"
)


def scrape(tmp_path: Path, prefix: str) -> str:
    """Starts ``kvtier serve`` with an nvme, an fs and a memory tier, returns one scrape of
    ``/metrics``, and stops it (SIGTERM, exit 0)."""
    nvme, fs = tmp_path / "nvme", tmp_path / "fs"
    nvme.mkdir()
    fs.mkdir()
    config = tmp_path / "kvtier.json"
    config.write_text(
        json.dumps(
            {
                "cpu_bytes_to_use": "8MiB",
                "secondary_tiers": [
                    {
                        "type": "nvme",
                        "paths": [str(nvme)],
                        "capacity_bytes": "16MiB",
                        "direct_io": "auto",
                    },
                    {"type": "fs", "root_dir": str(fs), "capacity_bytes": "16MiB"},
                    {"type": "memory"},
                ],
            }
        )
    )
    proc = subprocess.Popen(
        [KVTIER_BIN, "serve", "--config", str(config), "--metrics-addr", "127.0.0.1:0",
         "--metrics-prefix", prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        url = line.removeprefix("kvtier serve: listening on ")
        assert url.startswith("http://"), f"unexpected first line {line!r}"
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"] == prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
            text = answer.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return text


_scrapes: dict[str, str] = {}


def exposition_with(prefix: str, tmp_path_factory) -> str:
    """One scrape per prefix for the whole module."""
    if prefix not in _scrapes:
        _scrapes[prefix] = scrape(tmp_path_factory.mktemp("serve"), prefix)
    return _scrapes[prefix]


@pytest.fixture(params=["kvtier:", "vllm:"])
def exposition(request, tmp_path_factory) -> tuple[str, str]:
    """(prefix, scrape) with kvtier's default prefix and with vLLM's."""
    return request.param, exposition_with(request.param, tmp_path_factory)


def test_every_sample_is_under_its_declared_type(exposition):
    prefix, text = exposition
    families = list(text_string_to_metric_families(text))
    untyped = [f"{f.name} ({f.type}): {f.samples[:1]}" for f in families
               if f.type not in ("counter", "gauge", "histogram")]
    assert not untyped, "samples outside their declared family:\n" + "\n".join(untyped)
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family declared twice"
    assert all(n.startswith(prefix) for n in names), names
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(declared) == len(families)
    # Nothing was dropped: one parsed sample per sample line.
    sample_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert sum(len(f.samples) for f in families) == len(sample_lines)

    for f in families:
        if f.type == "counter":
            assert all(s.name == f.name + "_total" for s in f.samples), f.samples
            assert all(s.value >= 0 for s in f.samples), f.samples
        elif f.type == "histogram":
            series: dict[tuple, dict] = {}
            for s in f.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                part = series.setdefault(labels, {"buckets": []})
                if s.name == f.name + "_bucket":
                    part["buckets"].append((float(s.labels["le"]), s.value))
                else:
                    part[s.name.removeprefix(f.name)] = s.value
            for labels, part in series.items():
                bounds = [b for b, _ in part["buckets"]]
                counts = [c for _, c in part["buckets"]]
                assert bounds == sorted(bounds) and bounds[-1] == float("inf"), (f.name, labels)
                assert counts == sorted(counts), (f.name, labels, "not cumulative")
                assert part["_count"] == counts[-1] and "_sum" in part, (f.name, labels)


def vllm_declarations() -> dict:
    """vLLM's metric metadata for a tiering config: names with ``vllm:``, types, labels,
    buckets, documentation."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    return TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": []})


def vllm_family_text(name: str, metadata, samples) -> str:
    """One family as vLLM writes it: created by vLLM's ``OffloadPromMetrics._create_metric``
    (no per-engine labels) on a fresh registry, set to kvtier's values, written by
    ``generate_latest`` without the ``_created`` series."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    registry = CollectorRegistry()
    maker = types.SimpleNamespace(
        _labelnames=[],
        _counter_cls=functools.partial(Counter, registry=registry),
        _gauge_cls=functools.partial(Gauge, registry=registry),
        _histogram_cls=functools.partial(Histogram, registry=registry),
    )
    metric = OffloadPromMetrics._create_metric(maker, name, metadata)
    for s in samples:
        labels = [s.labels[k] for k in metadata.labelnames]
        child = metric.labels(*labels) if labels else metric
        if s.name.endswith("_total"):
            child.inc(s.value)
        elif s.name == name:
            child.set(s.value)
        # histograms: the series exists once labelled; kvtier's counts are checked to be 0
    return generate_latest(registry).decode()


def kvtier_family_text(text: str, exposed: str) -> str:
    """The lines of one family in kvtier's scrape, from its ``# HELP`` to the next one."""
    lines = text.splitlines(keepends=True)
    start = lines.index(next(line for line in lines if line.startswith(f"# HELP {exposed} ")))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("# HELP ")),
               len(lines))
    return "".join(lines[start:end])


@pytest.fixture
def no_created_series():
    prometheus_client.disable_created_metrics()
    yield
    prometheus_client.enable_created_metrics()


def test_vllm_metrics_are_written_as_vllm_writes_them(tmp_path_factory, no_created_series):
    # Under vLLM's own names (--metrics-prefix vllm:).
    text = exposition_with("vllm:", tmp_path_factory)
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

    families = {f.name: f for f in text_string_to_metric_families(text)}
    declared = vllm_declarations()
    tiering = {v for k, v in vars(TieringOffloadingMetrics).items() if k.isupper()}
    missing = sorted(tiering - families.keys())
    assert not missing, f"vLLM tiering metrics kvtier does not export: {missing}"

    compared, differences = [], []
    for name, metadata in declared.items():
        family = families.get(name)
        if family is None:
            continue  # (a CPU-offloading metric kvtier does not export; see docs/metrics.md)
        if family.type == "histogram":
            assert all(s.value == 0 for s in family.samples), (
                f"{name}: observations at start-up; this comparison needs zero counts")
        exposed = name + "_total" if family.type == "counter" else name
        ours = kvtier_family_text(text, exposed)
        theirs = vllm_family_text(name, metadata, family.samples)
        if ours != theirs:
            diff = difflib.unified_diff(
                theirs.splitlines(), ours.splitlines(), "vLLM", "kvtier", lineterm="", n=1
            )
            differences.append("\n".join(diff))
        compared.append(name)
    assert not differences, "\n".join(differences)
    assert tiering <= set(compared)


def test_docs_name_real_series(tmp_path_factory):
    """Every series ``docs/metrics.md`` names in backticks is one a scrape declares, with the
    labels it names."""
    import re

    prefix = "kvtier:"
    text = exposition_with(prefix, tmp_path_factory)
    declared = {line.split()[2].removeprefix(prefix) for line in text.splitlines()
                if line.startswith("# TYPE ")}
    labels: dict[str, set] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels.setdefault(s.name.removeprefix(prefix), set()).update(
                k for k in s.labels if k != "le")
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    named = re.findall(
        r"`((?:kv_offload|g3|fs|memory_tier|tiering)_[a-z0-9_]+)(?:\{([a-z_,]*)\})?`", docs)
    assert len(named) > 20, "the pattern no longer finds the tables"
    wrong = []
    for name, label_list in named:
        if name not in declared:
            wrong.append(f"{name}: no such series")
        elif label_list and name in labels and set(label_list.split(",")) != labels[name]:
            wrong.append(f"{name}{{{label_list}}}: its labels are {sorted(labels[name])}")
    assert not wrong, "docs/metrics.md:\n" + "\n".join(wrong)
