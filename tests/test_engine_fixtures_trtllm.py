"""Real TensorRT-LLM `/metrics` output (tests/fixtures/metrics/, each naming its source).

Every fixture is parsed with the profile its expected-trtllm.yaml entry names and
must give exactly the values listed there, or fail as a scrape: a page without
the queue, running and KV series (Triton without the TensorRT-LLM families, an
older backend, trtllm-serve's Prometheus page or its JSON statistics, an HTML
error page, HELP/TYPE lines without samples) is an error, never zeros. The live
test runs the real gateway against a stand-in pod serving the real Triton page.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from picker.datalayer.engines import Signal, profile_for
from picker.datalayer.parser import MetricsParseError, parse_metrics
from simulator.standin import HTML
from tests.procs import gateway, gateway_config
from tests.standin_thread import standin_pod

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load(
    (FIXTURES / "expected-trtllm.yaml").read_text())
TRITON = "triton-trtllm-2025-04.txt"
OLD_TRITON = "triton-trtllm-2025-02.txt"
HEADER = ("# source: ", "# engine: ", "# excerpt: ")


def _parse(name: str) -> Any:
    return parse_metrics((FIXTURES / name).read_text(), profile_for(EXPECTED[name]["engine"]))


def test_every_trtllm_fixture_has_an_expectation_and_names_its_source() -> None:
    on_disk = {p.name for p in FIXTURES.glob("*") if p.suffix in (".txt", ".json")
               and p.name.startswith(("triton", "trtllm"))}
    assert on_disk == set(EXPECTED)
    for name in EXPECTED:
        path = FIXTURES / name
        if path.suffix == ".json":  # JSON has no comments: the source is beside it
            head = (FIXTURES / f"{name}.source").read_text().splitlines()[:3]
            assert [line.split(":")[0] for line in head] == ["source", "engine", "excerpt"]
        else:
            head = path.read_text().splitlines()[:3]
            assert all(line.startswith(h) for line, h in zip(head, HEADER, strict=True)), name


@pytest.mark.parametrize("name", [n for n, e in EXPECTED.items() if "values" in e])
def test_fixture_gives_the_expected_values(name: str) -> None:
    snap = _parse(name)
    expected = {Signal(k): float(v) for k, v in EXPECTED[name]["values"].items()}
    assert snap.values == expected


@pytest.mark.parametrize("name", [n for n, e in EXPECTED.items() if "fails" in e])
def test_fixture_without_the_required_series_is_a_failed_scrape(name: str) -> None:
    with pytest.raises(MetricsParseError, match=EXPECTED[name]["fails"]):
        _parse(name)


def test_triton_label_set_is_model_and_version() -> None:
    """Triton labels every TensorRT-LLM series with the model name and version."""
    text = (FIXTURES / TRITON).read_text()
    label_sets = {tuple(sorted(re.findall(r'(\w+)="', m)))
                  for m in re.findall(r"^nv_trt_llm_\w+\{([^}]*)\}", text, re.M)}
    assert all({"model", "version"} <= set(labels) and len(labels) == 3
               for labels in label_sets), label_sets


def test_help_and_type_lines_without_samples_are_a_failed_scrape() -> None:
    """The real Triton page with its samples taken out, as before the first statistics."""
    text = (FIXTURES / TRITON).read_text()
    comments = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert "# TYPE nv_trt_llm_request_metrics gauge" in comments
    with pytest.raises(MetricsParseError):
        parse_metrics(comments, profile_for("trtllm"))


def test_html_error_page_is_a_failed_scrape() -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(HTML, profile_for("trtllm"))


def test_other_request_types_do_not_count_as_running() -> None:
    """`active` and `context` share the family with `scheduled`; only `scheduled` is read."""
    text = (FIXTURES / TRITON).read_text().replace(
        'request_type="scheduled",version="1"} 7', 'request_type="scheduled",version="1"} 9')
    assert parse_metrics(text, profile_for("trtllm")).get(Signal.RUNNING) == 9


def _gateway_gauges(text: str, pod: str) -> dict[str, float]:
    """The `igw_pod_*` samples of one pod on the gateway's own `/metrics` (scrapes by outcome)."""
    found: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(igw_pod_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        if f'pod="{pod}"' in labels:
            outcome = re.search(r'outcome="(\w+)"', labels)
            found[f"{name}:{outcome.group(1)}" if outcome else name] = float(value)
    return found


def test_gateway_reads_a_real_triton_page(tmp_path: Path) -> None:
    """`engineType: trtllm` through `igw serve`: the pod is ready with the page's numbers,
    and a pod serving the older backend's page (no "waiting", no "fraction") is not."""
    values = EXPECTED[TRITON]["values"]
    with (standin_pod("trtllm", (FIXTURES / TRITON).read_bytes()) as address,
          standin_pod("trtllm", (FIXTURES / OLD_TRITON).read_bytes()) as old):
        config = gateway_config([
            {"name": "triton", "modelName": "tensorrt_llm", "endpoints": [address],
             "engineType": "trtllm"},
            {"name": "old-triton", "modelName": "old", "endpoints": [old],
             "engineType": "trtllm"}])
        with gateway(tmp_path, config) as gw:
            url = f"http://127.0.0.1:{gw.ports['metrics']}/metrics"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                text = httpx.get(url, timeout=5).text
                gauges, old_gauges = _gateway_gauges(text, address), _gateway_gauges(text, old)
                if (gauges.get("igw_pod_ready") == 1.0
                        and old_gauges.get("igw_pod_scrapes_total:failed", 0) >= 3):
                    break
                time.sleep(0.1)
    assert gauges.get("igw_pod_ready") == 1.0, gauges
    assert gauges["igw_pod_waiting_requests"] == values["waiting"]
    assert gauges["igw_pod_running_requests"] == values["running"]
    assert gauges["igw_pod_kv_cache_usage_ratio"] == pytest.approx(values["kv_usage"])
    assert old_gauges.get("igw_pod_scrapes_total:failed", 0) >= 3, old_gauges
    assert old_gauges["igw_pod_ready"] == 0.0
    assert old_gauges["igw_pod_scrapes_total:ok"] == 0.0
