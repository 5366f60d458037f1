"""`jaxsmol bench --quick` end to end: every section is there, its numbers are positive, and the
mixed workload compiles nothing after compile-ahead. No timing assertions: speed is the benchmark's
output, not a test's (the machine running the tests may be busy).

It runs on the two-layer checkpoint (`tiny_model_dir`, with the real tokenizer): the subject is the
benchmark's harness, and the real model's ~30 programs took over 3 minutes of the suite to compile
and run. The real model's speed is what `jaxsmol bench` reports, not what a test checks."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real  # the real tokenizer (from the bundled model), tiny random weights


def _positive(x, what):
    assert isinstance(x, (int, float)) and x > 0, f"{what} = {x!r}"


def test_bench_quick_writes_every_section(tmp_path, tiny_model_dir):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "jaxsmol.cli.main", "bench", "--quick", "--model", str(tiny_model_dir),
           "--json", str(out)]
    plot = tmp_path / "bench.png"
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(plot)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HEADLINE 1008+16" in r.stdout
    res = json.loads(out.read_text())
    for section in ("meta", "compilations", "prefill", "decode", "ttft", "snapshot", "cli"):
        assert section in res, section

    assert [row["tokens"] for row in res["prefill"]]
    for row in res["prefill"]:
        _positive(row["tok_s"], f"prefill {row['tokens']} tok/s")
    assert {row["position"] for row in res["decode"]} == {64, 2000}
    for row in res["decode"]:
        _positive(row["tok_s"], f"decode at {row['position']} tok/s")

    t = res["ttft"]
    assert {row["suffix"] for row in t["grid"]} == {1, 16, 128}
    assert {row["exact"] for row in t["grid"]} == {True, False}
    for row in t["grid"] + t["modes"]:
        for k in ("cold_ttft_s", "warm_ttft_s", "exact_hit_ttft_s", "warm_over_cold"):
            _positive(row[k], f"{row['mode']} {row['prefix']}+{row['suffix']} {k}")
        assert row["warm_reused"] == row["prefix"]  # the warm prompt reuses exactly the shared prefix
    modes = {(row["mode"], row["exact"]) for row in t["modes"]}
    assert {("radix", True), ("radix", False), ("single", True)} <= modes
    assert all(row["exact_is_full_hit"] for row in t["modes"] if row["mode"] == "radix")
    h = t["headline"]
    assert (h["prefix"], h["suffix"]) == (1008, 16) and h["reused"] == 1008
    _positive(h["warm_over_cold"], "headline warm/cold")

    sn = res["snapshot"]
    # layers x (K, V) x kv heads x head dim x float32 bytes
    assert sn["bytes_per_token"] == res["meta"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert [row["n"] for row in sn["rows"]] == [1, 2, 4, 8]
    for row in sn["rows"]:
        _positive(row["bytes_held"], f"bytes held for {row['n']} branches")
        assert row["full_copies_bytes"] == row["n"] * (sn["trunk"] + sn["branch"]) * sn["bytes_per_token"]
    held = [row["bytes_held"] for row in sn["rows"]]
    assert held == sorted(held) and held[-1] < sn["rows"][-1]["full_copies_bytes"]  # the trunk is stored once

    c = res["compilations"]
    assert c["requests"] > 0 and 2 <= c["prompt_min"] <= c["prompt_max"] <= 1500
    _positive(c["programs_ahead"], "programs made ready ahead")
    assert c["programs_during"] == 0 and c["closed"]

    for case in ("without_cache", "with_cache"):
        _positive(res["cli"][case]["ttft_s"], f"fresh process {case} ttft")
        _positive(res["cli"][case]["wall_s"], f"fresh process {case} wall")
    if "--plot" in cmd:
        assert plot.stat().st_size > 0


def test_bench_compare_hf_without_torch_is_one_line_exit_2(tmp_path):
    """With torch missing, --compare hf names the extra to install (checked before any loading)."""
    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None:
        # hide them: a sitecustomize on the path makes their imports fail and find_spec return None
        (tmp_path / "sitecustomize.py").write_text(
            "import sys\nfor m in ('torch', 'transformers'):\n    sys.modules[m] = None\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "bench", "--compare", "hf", "--json",
                        str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "pip install -e '.[hf]'" in lines[0]
    assert not (tmp_path / "x.json").exists()


# ---- the sections run only when named in --only -----------------------------------------------------
def _bench(tmp_path, model_dir, *flags: str, plot: bool = True):
    """`jaxsmol bench --quick` with `flags`: (its stdout, the JSON, whether a plot was drawn)."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "jaxsmol.cli.main", "bench", "--quick", "--model", str(model_dir),
           "--json", str(out), *flags]
    plot = plot and importlib.util.find_spec("matplotlib") is not None
    r = subprocess.run(cmd + (["--plot", str(png)] if plot else []), capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not plot or png.stat().st_size > 0
    return r.stdout, json.loads(out.read_text())


def test_bench_in_process_sections(tmp_path, tiny_model_dir):
    """forks, prompt-cache, ttft-peer (without a peer: jaxsmol's two rows) and speculate at their smallest sizes."""
    stdout, res = _bench(tmp_path, tiny_model_dir, "--only", "forks", "prompt-cache", "ttft-peer", "speculate",
                         "--samples", "2",
                         "--tokens", "2", "--prompt-tokens", "24", "--rounds", "1", "--prefix", "40", "--suffix", "4",
                         "--draft-model", tiny_model_dir, "--report")
    assert res["meta"]["sections"] == ["forks", "prompt-cache", "ttft-peer", "speculate"]
    # the run's command (without its output files), machine and date, and its markdown table (--report)
    meta = res["meta"]
    assert meta["command"].startswith("jaxsmol bench --quick --model ") and "--json" not in meta["command"]
    assert meta["cpu"] and meta["cpus"] >= 1 and len(meta["date"]) == 10
    assert f"**{meta['cpu']}, {meta['cpus']} cores** ({meta['date']})" in stdout
    assert "| 2 samples x 2 tokens of one 24-token question | " in stdout
    assert ("| time to first token, 40 + 4 tokens, cold | " in stdout
            and "| time to first token, 4 new after 40 stored | " in stdout)
    assert set(res["meta"]["section_wall_s"]) == {"forks", "prompt-cache", "ttft-peer", "speculate"}
    assert not {"prefill", "decode", "ttft", "cli"} & set(res)  # the default run's sections did not run

    f = res["forks"]
    assert (f["samples"], f["tokens"], f["rounds"], f["prompt"]) == (2, 2, 1, 24)
    assert [r["way"] for r in f["rows"]] == ["sequential", "cached", "batched"]
    for r in f["rows"]:
        _positive(r["tok_s"], f"forks {r['way']} tok/s")
    assert "self-consistency: 2 samples x 2 tokens of one 24-token question" in stdout

    c = res["prompt-cache"]
    assert (c["prefix"], c["suffix"], c["repeats"]) == (40, 4, 1)
    _positive(c["file_bytes"], "snapshot file bytes")
    for k in ("cold_ttft_s", "disk_ttft_s", "load_s"):
        _positive(c[k], f"prompt-cache {k}")
    assert c["same_logits"] is True  # the state loaded from disk gives the cold prompt's logits, bit for bit
    assert "40 loaded from disk + 4 prefilled" in stdout

    t = res["ttft-peer"]
    assert (t["prefix"], t["suffix"], t["peer_url"]) == (40, 4, None)
    assert [r["way"] for r in t["rows"]] == ["jaxsmol exact", "jaxsmol fast"]
    for r in t["rows"]:
        _positive(r["cold_ttft_s"], f"{r['way']} cold")
        _positive(r["warm_ttft_s"], f"{r['way']} warm")
    assert "time to first token, 40 stored + 4 new tokens" in stdout

    sp = res["speculate"]
    assert (sp["tokens"], sp["rounds"], sp["peer_url"]) == (2, 1, None)
    assert [r["prompt"] for r in sp["rows"]] == ["copy", "rename", "turn 2", "json", "open"]
    for r in sp["rows"]:
        assert r["same"] is True  # speculation's output is plain decoding's
        for way in ("none", "fresh", "again", "draft"):  # draft: --draft-model's drafts
            _positive(r[f"{way}_tok_s"], f"speculate {r['prompt']} {way} tok/s")
    assert "speculation, one stream, greedy, 2 tokens" in stdout and "draft tok/s" in stdout
    b = sp["batch"]
    assert b["clients"] == 8 and b["same"] is True
    _positive(b["plain_tok_s"], "speculate batch plain tok/s")
    _positive(b["spec_tok_s"], "speculate batch tok/s")
    assert "the same prompts and three more open ones as one batch, 2 tokens each" in stdout


def test_bench_daemon_sections_against_a_peer(tmp_path, tiny_model_dir, monkeypatch):
    """serve (with long prompts arriving) and ttft-peer with --peer-url pointed at a jaxsmol daemon this
    test starts (it has no llama.cpp /completion route: asked on /v1/completions), and first-burst."""
    from jaxsmol.cli.bench.daemon import Daemon

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    flags = ["--model", str(tiny_model_dir), "--ctx", "2048", "--max-batch", "2", "--no-compile-ahead"]
    with Daemon(flags) as peer:
        stdout, res = _bench(tmp_path, tiny_model_dir, "--only", "serve", "first-burst", "ttft-peer",
                             "--peer-url", peer.url, "--clients", "1", "2", "--tokens", "2", "--max-batch", "2",
                             "--idle", "0", "--rounds", "1", "--prefix", "40", "--suffix", "4", "--report",
                             "--peer-name", "peer-daemon")
        assert peer.proc.poll() is None  # the peer is left running
    assert res["meta"]["peer_url"] == peer.url

    s = res["serve"]
    assert s["peer_url"] == peer.url and "--max-batch" in s["daemon_flags"]
    rows = [(r["server"], r["clients"], r["long_prompts"]) for r in s["rows"]]
    assert rows == [(server, c, long_) for long_ in (False, True) for c in (1, 2) for server in ("jaxsmol", "peer")]
    for r in s["rows"]:
        # ignore_eos: every answer has its 2 tokens; the arrivals counted also take in the last chunk
        # (finish_reason, empty text), as tools/bench_serve.py counted them
        assert 2 * r["clients"] <= r["tokens"] <= 3 * r["clients"]
        _positive(r["tok_s"], f"serve {r['server']} {r['clients']} tok/s")
        _positive(r["ttft_p50_ms"], "ttft p50")
        if r["long_prompts"]:
            assert r["long_answered"] >= 1
    assert "serving: concurrent streaming clients, 2 tokens each" in stdout and f"the peer {peer.url}" in stdout

    assert [r["way"] for r in res["ttft-peer"]["rows"]] == ["jaxsmol exact", "jaxsmol fast", "peer"]
    # the markdown table: jaxsmol beside the named peer, row by row
    assert "| 2 streaming clients, 2 tokens each | " in stdout and "| 2 streaming clients against 1 client | " in stdout
    assert "| 2 streaming clients while 1000-token prompts arrive | ITL p99 " in stdout
    assert "| peer-daemon " in stdout
    _positive(res["ttft-peer"]["rows"][-1]["warm_ttft_s"], "peer warm ttft")

    b = res["first-burst"]
    assert [(r["setting"], r["burst"]) for r in b["rows"]] == [
        (setting, burst) for setting in ("compile ahead", "--no-compile-ahead")
        for burst in ("first burst", "second burst")]
    for r in b["rows"]:
        _positive(r["healthy_after_s"], "healthy after")
        _positive(r["ttft_p50_ms"], f"{r['setting']} {r['burst']} ttft")
    assert "a fresh daemon's first burst: 2 clients x 2 tokens" in stdout


def test_bench_ready_section_starts_twice_and_streams_at_ready(tmp_path, tiny_model_dir):
    """ready: a daemon started on an empty data directory, then again on the one it filled; each ready
    (/health 200) after it listened, its memory at ready and after 8 streams read from /metrics, and a
    stream at ready compared with the settled ones."""
    # --max-batch 1: the fresh start compiles 14 programs ahead where --max-batch 2 made 22 (the widths 1 and 2,
    # their verify steps): ~10 s less of the test's ~40 s on 2 cores; the section's harness is the subject
    stdout, res = _bench(tmp_path, tiny_model_dir, "--only", "ready", "--tokens", "3", "--max-batch", "1")
    r = res["ready"]
    assert [row["start"] for row in r["rows"]] == ["fresh", "second"]
    for row in r["rows"]:
        assert 0 < row["listening_s"] <= row["ready_s"]
        assert 0 < row["programs_mb"] < row["resident_mb"] and row["programs"] > 0 and row["resident_after_8_mb"] > 0
        assert row["at_ready_tok_s"] > 0 and row["settled_tok_s"] > 0
        assert row["share"] == pytest.approx(row["at_ready_tok_s"] / row["settled_tok_s"])
    assert r["tokens"] == 3 and r["settled_streams"] == 2
    assert "start to ready" in stdout and "at ready / settled" in stdout
