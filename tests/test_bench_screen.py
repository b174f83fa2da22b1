"""bench.screen: which members it picks, its arithmetic, and a member screened on unchanged code
reads exactly its baseline (the twin runs for real)."""

from __future__ import annotations

import math

import orjson
import pytest

from bench import screen
from bench.family import run_scenario, scenario


def _row(index: int, engine: str, adapters: int, p95: float = 1.0) -> dict:
    return {"name": f"family-0-{index}", "gateway": {"ttft_p95": p95},
            "params": {"seed": 0, "index": index,
                       "pools": [{"engine": "vllm", "adapters": 0},
                                 {"engine": engine, "adapters": adapters}]}}


def test_select_by_members_engine_and_adapters() -> None:
    rows = [_row(0, "trtllm", 0), _row(1, "sglang", 8), _row(2, "trtllm", 4), _row(3, "vllm", 0)]
    names = lambda chosen: [r["name"] for r in chosen]  # noqa: E731
    assert names(screen.select(rows)) == [r["name"] for r in rows]
    assert names(screen.select(rows, engine="trtllm")) == ["family-0-0", "family-0-2"]
    assert names(screen.select(rows, adapters=True)) == ["family-0-1", "family-0-2"]
    assert names(screen.select(rows, [0, 1], "trtllm", True)) == []
    assert names(screen.select(rows, [2, 3], "trtllm")) == ["family-0-2"]


def test_summary_is_the_geometric_mean_and_names_what_moved() -> None:
    pairs = [(_row(0, "vllm", 0, 1.0), _row(0, "vllm", 0, 2.0)),
             (_row(1, "vllm", 0, 1.0), _row(1, "vllm", 0, 0.5)),
             (_row(2, "vllm", 0, 1.0), _row(2, "vllm", 0, 1.04))]
    info = screen.summary(pairs)
    assert info["members"] == 3
    assert info["geomean"] == pytest.approx(math.exp(math.log(1.04) / 3))
    assert {name for _, name in info["moved"]} == {"family-0-0", "family-0-1"}
    assert screen.summary([])["members"] == 0


def test_a_member_on_unchanged_code_reads_its_baseline_and_a_changed_plan_is_skipped(
        tmp_path, capsys) -> None:
    row = run_scenario(scenario(0, 16), None, [0])
    assert screen.screen_row(row)["gateway"] == row["gateway"]
    assert screen.screen_row({**row, "fingerprint": "another plan"}) is None
    base = tmp_path / "family.json"
    base.write_bytes(orjson.dumps({"seed": 0, "scenarios": [row]}))
    assert screen.main(["--seed", "0", "--base", str(base), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "family-0-16: x best-ttft" in out and "geometric mean 1.0000; moved" in out
    assert screen.main(["--seed", "1", "--base", str(base)]) == 2
    with pytest.raises(SystemExit) as bad:  # argparse's usage error, not a traceback
        screen.main(["--seed", "0", "--base", str(base), "--members", "16,x"])
    assert bad.value.code == 2
