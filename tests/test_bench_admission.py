"""`jaxsmol bench --only admission` on the two-layer checkpoint (`tiny_model_dir`, the real tokenizer):
two daemons, one per admission order, the same few-shot workload, their rows and the side-by-side table.
The figures themselves are the benchmark's to report, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.real  # the real tokenizer, random two-layer weights


def test_admission_section_runs_both_orders_on_the_same_workload(tmp_path, tiny_model_dir):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jaxsmol.cli.main", "bench", "--quick", "--only", "admission",
           "--model", str(tiny_model_dir), "--clients", "3", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["admission"]
    assert [(row["workload"], row["admission"]) for row in res["rows"]] == [
        ("bursts", "lpm"), ("bursts", "fifo"), ("churn", "lpm"), ("churn", "fifo")]
    for row in res["rows"]:
        assert row["requests"] == 3 * 2  # clients x requests, every one answered
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert 0 <= row["cached_share"] <= 1 and row["req_s"] > 0
    bursts = [row for row in res["rows"] if row["workload"] == "bursts"]
    assert all(row["cached_share"] > 0 for row in bursts)  # the shared blocks are found
    flags = res["daemon_flags"]
    assert flags["bursts lpm"][:2] == ["--admission", "lpm"] and flags["churn fifo"][:2] == ["--admission", "fifo"]
    assert "--cache-bytes" in flags["churn lpm"] and "--cache-bytes" not in flags["bursts lpm"]
    for kind in ("bursts", "churn"):
        assert f"{kind}: lpm / fifo (medians over rounds): TTFT p50" in r.stdout
