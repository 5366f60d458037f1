"""`jaxsmol bench --report`: the markdown performance table of docs/performance.md and the README.

The table's rows are what the benchmark can produce: each row of the pages, run through the report
with results of the sections its command runs (made here in the shape the sections write), is one of
the report's rows, with the peer the command measures. The README's table is the page's. Merging runs
gives ranges; `--report FILES` prints earlier runs' table without loading a model. No model here:
tests/test_bench.py runs the sections and the report on a two-layer checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from jaxsmol.cli.bench.performance import HEADER, markdown, rows_of
from jaxsmol.cli.bench.plans import FULL, SECTIONS, with_flags
from jaxsmol.cli.bench.run import command_line
from jaxsmol.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]


def fake_results(sections, plan, peer_name: str | None = None, date: str = "2026-12-03", scale: float = 1.0) -> dict:
    """Results of `sections` at the plan's sizes, shaped as cli/bench/*.py write them (values made up);
    a peer (`peer_name`) where the section measures one."""
    peer = peer_name is not None
    res = {"meta": {"sections": list(sections), "cpus": 2, "cpu": "Test CPU", "date": date, "peer_name": peer_name}}
    if "prefill" in sections:
        res["prefill"] = [{"tokens": n, "tok_s": 1000.0 * scale} for n in plan["prefill"]]
    if "decode" in sections:
        res["decode"] = [{"position": p, "tok_s": 40.0 * scale} for p in plan["decode_positions"]]
    if "hf" in sections:
        p, s = 1008, 16
        rows = [{"metric": f"prefill {n} (tok/s)", "jaxsmol": 1100.0 * scale, "hf": 1000.0} for n in plan["hf_prefill"]]
        rows += [{"metric": f"decode at {q} (tok/s)", "jaxsmol": 40.0 * scale, "hf": 30.0}
                 for q in plan["decode_positions"]]
        rows += [{"metric": f"ttft cold {p}+{s} (ms)", "jaxsmol": 950.0, "hf": 1000.0},
                 {"metric": f"ttft warm {p}+{s} (ms)", "jaxsmol": 41.0, "hf": 88.0},
                 {"metric": f"warm/cold {p}+{s}", "jaxsmol": 41 / 950, "hf": 88 / 1000}]
        res["hf"] = {"transformers": "5.24.0", "torch": "2.13.0", "rows": rows}
    if "ttft-peer" in sections:
        ways = ([("jaxsmol exact", 0.94, 0.040), ("jaxsmol fast", 0.95, 0.050)]
                + ([("peer", 1.59, 0.251)] if peer else []))
        res["ttft-peer"] = {"prefix": plan["peer_prefix"], "suffix": plan["peer_suffix"], "rounds": 1,
                            "peer_url": "http://peer" if peer else None,
                            "rows": [{"way": w, "cold_ttft_s": c, "warm_ttft_s": m, "cold_over_warm": c / m}
                                     for w, c, m in ways]}
    if "serve" in sections:
        rows = [{"server": server, "clients": c, "long_prompts": long_, "tok_s": 30.0 * c * scale,
                 "steady_tok_s": None if long_ else 35.0 * c, "ttft_p50_ms": 400.0, "ttft_p99_ms": 500.0,
                 "itl_p50_ms": 30.0, "itl_p99_ms": 150.0, "long_answered": 3 if long_ else 0, "long_ttft_ms": None}
                for long_ in ((False, True) if plan["serve_long"] else (False,)) for c in plan["serve_clients"]
                for server in (("jaxsmol", "peer") if peer else ("jaxsmol",))]
        res["serve"] = {"tokens": plan["serve_tokens"], "peer_url": "http://peer" if peer else None, "rows": rows,
                        "clients": list(plan["serve_clients"]), "daemon_flags": []}
    if "forks" in sections:
        res["forks"] = {"samples": plan["forks_n"], "tokens": plan["forks_tokens"], "prompt": plan["forks_prompt"],
                        "rounds": plan["forks_rounds"],
                        "rows": [{"way": w, "seconds": t} for w, t in (("sequential", 29.9), ("cached", 12.0),
                                                                       ("batched", 3.9 / scale))]}
    if "ready" in sections:
        res["ready"] = {"rows": [{"start": start, "listening_s": 5.0, "ready_s": t, "at_ready_tok_s": 40.0,
                                  "settled_tok_s": 42.0, "share": 40 / 42} for start, t in (("first", 280.0),
                                                                                          ("second", 60.0))]}
    if "cluster" in sections:
        runs = [{"variant": v, "policy": p, "hit_rate": h, "prefilled": f, "req_s": q, "ttft_p50_ms": t}
                for v in plan["cluster_variants"]
                for p, h, f, q, t in (("round_robin", 0.43, 34792, 0.31, 5559.0),
                                      ("cache_aware", 0.85, 9000, 0.9, 700.0))]
        res["cluster"] = {"replicas": plan["cluster_replicas"], "tenants": plan["cluster_tenants"],
                          "per_tenant": plan["cluster_per_tenant"], "clients": plan["cluster_clients"], "rows": runs}
    if "admission" in sections:
        runs = [{"workload": w, "admission": o, "ttft_p50_ms": t50, "ttft_p99_ms": t99}
                for w in plan["admission_workloads"]
                for o, t50, t99 in (("lpm", 2000.0, 9000.0), ("fifo", 4000.0, 12000.0))]
        res["admission"] = {"clients": plan["admission_clients"], "requests": plan["admission_requests"],
                            "blocks": plan["admission_blocks"], "churn_blocks": plan["admission_churn_blocks"],
                            "hot": plan["admission_hot"], "block_tokens": plan["admission_block_tokens"],
                            "cache_blocks": plan["admission_cache_blocks"], "rows": runs}
    return res


def doc_tables(path: Path) -> list[list[str]]:
    """The cells of every row of the report's tables in a page (those with the report's header)."""
    lines, rows, inside = path.read_text().splitlines(), [], False
    for line in lines:
        if line == "| " + " | ".join(HEADER) + " |":
            inside = True
        elif inside and line.startswith("|---"):
            continue
        elif inside and line.startswith("| "):
            rows.append([c.strip() for c in line.strip()[1:-1].split("|")])
        else:
            inside = False
    return rows


def produced_by(command: str) -> dict[str, list]:
    """{row name: [rows]} the report gives for a run of `command` (a `jaxsmol bench ...` line)."""
    words = shlex.split(command)
    assert words[:2] == ["jaxsmol", "bench"], command
    args = build_parser().parse_args(words[1:])
    sections = list(args.only or SECTIONS) + (["hf"] if args.compare == "hf" else [])
    res = fake_results(sections, with_flags(FULL, args),
                       peer_name=(args.peer_name or "peer") if args.peer_url else None)
    out: dict[str, list] = {}
    for row in rows_of(res):
        out.setdefault(row.name, []).append(row)
    return out


def test_every_row_of_the_pages_is_one_the_benchmark_produces():
    rows = doc_tables(ROOT / "docs" / "performance.md")
    assert len(rows) >= 20
    for name, _ours, peer, _ratio, command in rows:
        commands = [c for c in command.split("`")[1::2]]
        assert len(commands) == 1, command
        produced = produced_by(commands[0])
        assert name in produced, f"{name!r}: `{commands[0]}` produces no such row ({sorted(produced)})"
        made = produced[name][0]
        assert bool(peer) == bool(made.peer), (f"{name!r}: a peer cell where the command measures none, "
                                               "or none where it does")
        if peer:  # the peer the command measures: transformers, the --peer-name server, jaxsmol's own runs
            assert peer.split()[0] == made.peer.split()[0], (name, peer, made.peer)


def test_the_readme_table_is_the_performance_pages():
    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs" / "performance.md").read_text()
    rows = doc_tables(ROOT / "README.md")
    assert rows, "the README has no performance table"
    block = readme[readme.index("**", readme.index("## Performance")):].split("\n\n## ", 1)[0].strip()
    assert block in page  # the machine line and every row, as the page has them


def test_report_of_each_section_names_its_peer():
    res = fake_results(["prefill", "decode", "hf", "ttft-peer", "serve", "forks", "ready"],
                       dict(FULL, serve_clients=(1, 8)), peer_name="llama.cpp")
    text = markdown([res])
    assert text.startswith("**Test CPU, 2 cores** (2026-12-03)")
    assert "| " + " | ".join(HEADER) + " |" in text
    assert "| prefill 512 tokens | 1100 tok/s | transformers 5.24.0 1000 tok/s | 1.10x |" in text
    assert "| time to first token, 1008 + 16 tokens, cold | 940 ms | llama.cpp 1590 ms | 1.69x |" in text
    assert ("| 8 streaming clients, 64 tokens each | 240.0 tok/s (steady 280) "
            "| llama.cpp 240.0 tok/s (steady 280) | 1.00x |" in text)
    assert "| 8 streaming clients against 1 client | 8.00x the tokens a second |" in text
    assert "| 8 samples x 64 tokens of one 500-token question | 3.90 s batched (one prefill, 8 forks) |" in text
    assert "start to ready, empty compilation cache" in text and "start to ready, filled compilation cache" in text
    assert "prefill 128 tokens" not in text  # with transformers measured, the prefill rows are hf's


def test_runs_merge_into_ranges_and_machines_into_tables():
    plan = dict(FULL, serve_clients=(1, 8, 1, 8))
    a = fake_results(["serve", "forks"], plan, peer_name="llama.cpp", date="2026-12-02")
    b = fake_results(["serve", "forks"], plan, peer_name="llama.cpp", scale=1.5)
    c = dict(fake_results(["forks"], plan), meta={**a["meta"], "cpu": "Other CPU", "sections": ["forks"]})
    text = markdown([a, b, c])
    assert "**Test CPU, 2 cores** (2026-12-02, 2026-12-03)" in text and "**Other CPU, 2 cores**" in text
    assert "| 8 streaming clients, 64 tokens each | 240.0-360.0 tok/s (steady 280)" in text
    assert "`jaxsmol bench --only serve forks` (2 runs)" in text
    assert "2.60-3.90 s batched" in text


def test_report_of_results_files_loads_no_model(tmp_path):
    files = []
    for i, res in enumerate([fake_results(["forks"], FULL), fake_results(["forks"], FULL, scale=2.0)]):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps(res))
    r = subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "bench", "--report", *map(str, files),
                        "--model", "/nonexistent"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert "| 8 samples x 64 tokens of one 500-token question | 1.95-3.90 s batched" in r.stdout


def test_report_of_a_file_that_is_not_results_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    r = subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "bench", "--report", str(bad),
                        str(tmp_path / "missing.json")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --report:") and "x.json" in lines[0]


def test_the_recorded_command_leaves_out_the_output_files():
    assert command_line(["bench", "--only", "serve", "--json", "x.json", "--report", "--clients", "1", "8",
                         "--plot=p.png"]) == "jaxsmol bench --only serve --clients 1 8"
    assert command_line(["bench", "--report", "a.json", "b.json"]) == "jaxsmol bench"
    assert (command_line(["bench", "--compare", "hf", "--peer-name", "llama.cpp"])
            == "jaxsmol bench --compare hf --peer-name llama.cpp")
