"""`jaxsmol bench` is the one entry point for the benchmarks a user runs: its --only sections and their
flags, --peer-url and --draft-model refused without a section that measures them, and tools/ holding only maintainers'
scripts (generators, kernel timers), each with a one-line summary and its usage in its docstring.
No model is loaded here; tests/test_bench.py runs the sections."""

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsmol.cli.bench.plans import EXTRA_SECTIONS, FULL, QUICK, SECTIONS, with_flags
from jaxsmol.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
MAINTAINER_PREFIXES = ("make_", "time_", "profile_", "kernel_", "ab_")  # generators, kernel timing, XLA flag A/B


def test_only_takes_every_section_and_the_peer_flags():
    args = build_parser().parse_args(["bench", "--only", *SECTIONS, *EXTRA_SECTIONS, "--peer-url", "http://h:1",
                                      "--clients", "1", "8", "--no-long"])
    assert args.only == list(SECTIONS + EXTRA_SECTIONS) and args.peer_url == "http://h:1"
    assert set(EXTRA_SECTIONS) == {"forks", "prompt-cache", "ttft-peer", "serve", "first-burst", "ready", "cluster",
                                   "admission", "speculate"}
    assert not set(EXTRA_SECTIONS) & set(SECTIONS)  # the default run does not grow


def test_flags_override_the_plan_and_nothing_else():
    args = build_parser().parse_args(["bench", "--tokens", "3", "--clients", "2", "5", "--rounds", "4",
                                      "--prefix", "64", "--samples", "2", "--batch-invariant"])
    plan = with_flags(QUICK, args)
    assert plan["serve_tokens"] == plan["forks_tokens"] == plan["burst_tokens"] == plan["ready_tokens"] == 3
    assert plan["serve_clients"] == (2, 5) and plan["burst_clients"] == 5
    assert plan["forks_rounds"] == plan["pc_repeats"] == plan["peer_rounds"] == plan["burst_rounds"] == 4
    assert plan["pc_prefix"] == plan["peer_prefix"] == 64 and plan["forks_n"] == 2
    assert plan["serve_batch_invariant"] and plan["serve_long"]
    assert (plan["admission_tokens"], plan["admission_clients"], plan["admission_rounds"]) == (3, 5, 4)
    assert (plan["spec_tokens"], plan["spec_rounds"]) == (3, 4)
    untouched = {k for k in QUICK if plan[k] == QUICK[k]}
    assert untouched >= set(QUICK) - {"serve_tokens", "forks_tokens", "burst_tokens", "ready_tokens", "serve_clients",
                                      "burst_clients", "cluster_clients", "admission_tokens", "admission_clients",
                                      "forks_rounds", "pc_repeats", "peer_rounds", "burst_rounds", "pc_prefix",
                                      "admission_rounds", "peer_prefix", "forks_n", "serve_batch_invariant",
                                      "spec_tokens", "spec_rounds"}
    assert with_flags(FULL, build_parser().parse_args(["bench"])) == FULL
    assert with_flags(FULL, argparse.Namespace()) == FULL  # a caller without the flags


@pytest.mark.parametrize("flag, value, named", [("--peer-url", "http://127.0.0.1:9", "serve"),
                                                ("--draft-model", "x", "speculate")])
def test_a_flag_without_its_section_is_one_line_exit_2(tmp_path, flag, value, named):
    r = subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "bench", "--only", "prefill", flag, value,
                        "--json", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and named in lines[0]
    assert not (tmp_path / "x.json").exists()


def test_tools_hold_no_user_facing_benchmark():
    """Every benchmark a user runs is a `jaxsmol bench` section; tools/ keeps maintainers' scripts, each
    with a one-line summary and its usage (`python tools/NAME.py ...`) in its docstring."""
    scripts = sorted(TOOLS.glob("*.py"))
    assert scripts
    for path in scripts:
        assert not path.name.startswith("bench"), f"{path.name}: a benchmark belongs in `jaxsmol bench --only ...`"
        assert path.name.startswith(MAINTAINER_PREFIXES), f"{path.name}: not a generator or kernel timer"
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc, f"{path.name} has no docstring"
        lines = doc.splitlines()
        assert len(lines) == 1 or not lines[1].strip(), f"{path.name}: the docstring's summary is not one line"
        assert any(line.strip().startswith(("python tools/", "PYTHONPATH=$PWD python tools/",
                                            ".refenv/bin/python tools/"))
                   for line in lines), f"{path.name}: no usage line in its docstring"
