"""Prefix snapshots on disk as the daemon's second tier (cache/store/disk.py's DiskStore behind the prefix
cache: spills, warm restarts, its budget), and --prompt-cache across processes; the file format and
its refusals are in tests/test_disk_cache.py.

The in-process tests use the tiny engine; the two marked `real` start processes on the two-layer
checkpoint with the real tokenizer (`tiny_model_dir`): two `jaxsmol generate --prompt-cache` runs, and a
daemon restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxsmol.cache.store import snapshot
from jaxsmol.cache.store.disk import DiskStore
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.store.snapshot import Snapshot
from cache_runs import toks
from daemon import ROOT, free_port
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

SP = SamplingParams(max_tokens=4)


# ---- the daemon's second tier, in process ------------------------------------------------------------
def test_eviction_spills_to_disk_and_a_miss_brings_it_back(tiny_engine, tmp_path):
    P, R = toks(100, 4), toks(100, 5)
    budget = 120 * tiny_engine.kv_bytes_per_token  # one prompt (plus its answer) at a time
    store = DiskStore(tmp_path, snapshot.identity(tiny_engine), 1 << 20)
    cache = PrefixCache(tiny_engine, budget_bytes=budget, disk=store)
    first = generate(cache, P, SP)
    generate(cache, R, SP)  # evicts P: written to disk
    assert cache.stats.evictions >= 1 and len(store) >= 1 and cache.stats.disk_writes >= 1
    gen = generate(cache, P, SP)  # a memory miss, found on disk
    report = gen.report
    assert report.disk_loaded == 100 and report.exact_hit and cache.stats.disk_loads == 1
    assert gen.output_ids == first.output_ids and np.array_equal(gen.prompt_logits, first.prompt_logits)
    # a longer prompt: the disk entry is a prefix of it
    Q = R + toks(10, 6)  # R went to disk when P came back
    gen = generate(cache, Q, SP)
    report = gen.report
    cold = generate(tiny_engine, Q, SP)
    assert report.reused >= 100 and np.array_equal(gen.prompt_logits, cold.prompt_logits)
    assert store.bytes_held <= store.budget_bytes


def test_persist_and_warm_across_a_restart(tiny_engine, tmp_path):
    P, R = toks(80, 7), toks(60, 8)
    ident = snapshot.identity(tiny_engine)
    cache = PrefixCache(tiny_engine, disk=DiskStore(tmp_path, ident))
    first = generate(cache, P, SP)
    generate(cache, R, SP, salt="tenant")
    assert cache.persist_to_disk() == 2  # one file per stored key (P + answer, R + answer)
    other = DiskStore(tmp_path, {**ident, "tokenizer": "x"})  # another tokenizer: left alone
    assert len(other) == 0 and len(other.skipped) == 2 and "another tokenizer" in other.skipped[0][1]
    restarted = PrefixCache(tiny_engine, disk=DiskStore(tmp_path, ident))
    assert restarted.warm_from_disk() == 2 and len(restarted.disk) == 2
    gen = generate(restarted, P, SP)
    report = gen.report
    assert report.exact_hit and report.disk_loaded == 0 and gen.output_ids == first.output_ids
    assert generate(restarted, R, SP).report.reused == 0  # salts stay apart
    assert generate(restarted, R, SP, salt="tenant").report.exact_hit
    restarted.flush()  # forgets both tiers
    assert len(restarted.disk) == 0 and generate(restarted, P, SP).report.reused == 0


def test_disk_budget_keeps_the_newest(tiny_engine, tmp_path):
    ident = snapshot.identity(tiny_engine)
    snaps = [Snapshot(tuple(toks(50, 10 + i)), np.zeros((2, 1, 2, 50, 16), np.float32),
                      np.zeros((2, 1, 2, 50, 16), np.float32)) for i in range(3)]
    store = DiskStore(tmp_path, ident, budget_bytes=int(2.5 * snaps[0].nbytes) + 4096)
    for s in snaps:
        assert store.put(s)
        time.sleep(0.01)
    assert [e.tokens for e in store.newest_first()] == [snaps[2].tokens, snaps[1].tokens]
    assert not (tmp_path / store.name_of("", snaps[0].tokens)).exists()
    assert not DiskStore(tmp_path, ident, budget_bytes=100).put(snaps[0])  # never fits


def test_a_file_refused_for_its_checksum_is_logged_deleted_and_counted(tiny_engine, tmp_path, caplog):
    """The daemon warms from a directory holding a file whose data was damaged: it is deleted with a
    warning naming it and why, and /metrics counts it by reason."""
    from fastapi.testclient import TestClient

    from jaxsmol.cli.server.serve import create_app

    store = DiskStore(tmp_path, snapshot.identity(tiny_engine))
    k = np.ones((2, 1, 2, 50, 16), np.float32)
    assert store.put(Snapshot(tuple(toks(50, 20)), k, k))
    (path,) = tmp_path.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-1000] ^= 1  # a bit of the keys' bytes: the header still reads
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="jaxsmol.cache"), \
            TestClient(create_app(tiny_engine, model_name="tiny", cache_dir=tmp_path)) as client:
        text = client.get("/metrics").text
    assert 'jaxsmol_cache_disk_refused_total{reason="checksum"} 1.0' in text
    assert 'jaxsmol_cache_disk_refused_total{reason="corrupted"} 0.0' in text
    assert not path.exists()
    (warning,) = [r for r in caplog.records if r.name == "jaxsmol.cache"]
    assert warning.levelname == "WARNING" and str(path) in warning.getMessage() and "checksum" in warning.getMessage()


# ---- real model, separate processes ---------------------------------------------------------------------
def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.real
def test_two_cli_runs_share_a_prompt_cache(tiny_model_dir, tmp_path):
    f = tmp_path / "prompt.cache"
    args = ("generate", "The capital of France is", "--model", tiny_model_dir, "--max-tokens", 4, "--json",
            "--prompt-cache", f)
    r1 = _cli(*args)
    assert r1.returncode == 0, r1.stderr
    one = json.loads(r1.stdout)
    assert one["cache"] == {"reused": 0, "source": None, "refused": None, "file": str(f),
                            "saved": len(one["prompt_ids"]) + len(one["output_ids"])}
    r2 = _cli(*args)
    assert r2.returncode == 0, r2.stderr
    two = json.loads(r2.stdout)
    n = len(one["prompt_ids"])
    assert two["cache"]["reused"] == n and two["cache"]["source"] == "prompt-cache"
    assert two["timings"]["prefilled_tokens"] == 0 and two["output_ids"] == one["output_ids"]
    f.write_bytes(f.read_bytes()[:-100])  # truncated: a warning, then the cold path
    r3 = _cli(*args)
    assert r3.returncode == 0, r3.stderr
    three = json.loads(r3.stdout)
    assert "warning: prompt cache not used:" in r3.stderr and "truncated" in three["cache"]["refused"]
    assert three["cache"]["reused"] == 0 and three["output_ids"] == one["output_ids"]
    assert three["cache"]["saved"] > 0  # a damaged snapshot is ours: replaced by a good one
    notes = tmp_path / "notes.txt"  # a typo naming the user's own file: one warning, the file intact
    notes.write_text("my notes\n")
    r4 = _cli(*args[:-1], notes)
    assert r4.returncode == 0, r4.stderr
    four = json.loads(r4.stdout)
    warnings = [line for line in r4.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "not overwritten" in warnings[0] and four["cache"]["saved"] == 0
    assert notes.read_text() == "my notes\n" and four["output_ids"] == one["output_ids"]


def _start_server(model: Path, cache_dir: Path, log):
    port = free_port()
    # --no-compile-ahead: ready at once, as tests/daemon.py's daemons (what a restart keeps is the subject here)
    proc = subprocess.Popen([sys.executable, "-m", "jaxsmol.cli.main", "serve", "--port", str(port), "--ctx", "2048",
                             "--model", str(model), "--cache-dir", str(cache_dir), "--no-compile-ahead"], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    import httpx

    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, _log(log)
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.25)


def _log(log) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


@pytest.mark.real
def test_daemon_restart_keeps_its_hits(tiny_model_dir, tmp_path):
    import httpx

    body = {"prompt": "Here is a list of facts. Fact 1: the sky is blue. Fact 2: grass is green. Question:",
            "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    answers = []
    with tempfile.TemporaryFile() as log:
        for _run in range(2):
            proc, url = _start_server(tiny_model_dir, tmp_path / "cache", log)
            try:
                r = httpx.post(url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                answers.append(r.json())
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(120)
            assert rc == 0, _log(log)
            assert list((tmp_path / "cache").glob("*.safetensors")), _log(log)
    first, second = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"]
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_a_background_store_writes_on_its_thread_and_reads_only_what_is_written(tiny_engine, tmp_path,
                                                                                 monkeypatch):
    """With background=True (the daemon's) a spill's file is written on the writer thread: the entry is
    indexed at once but found only once written; a write that fails leaves the index at the next put, an
    entry dropped before its write leaves no file, and past QUEUE_BYTES queued a put writes at once."""
    from jaxsmol.cache.store import disk as disk_module

    ident = snapshot.identity(tiny_engine)
    gate, threads, save = threading.Event(), set(), disk_module.save_snapshot

    def held_save(path, snap, ident_):
        threads.add(threading.current_thread().name)
        gate.wait(10)
        if snap.length == 7:
            raise OSError(28, "No space left on device")
        return save(path, snap, ident_)
    monkeypatch.setattr(disk_module, "save_snapshot", held_save)
    store = DiskStore(tmp_path, ident, background=True)
    cache = PrefixCache(tiny_engine, disk=store)
    P = toks(40, 60)
    generate(cache, P, SP)
    snap = cache.snapshot_of(P)
    assert store.put(snap) and store.entries[store.name_of("", P)].pending
    assert store.find("", P) == (None, 0)  # not a file yet
    gate.set()
    store.drain()
    assert threads == {"jaxsmol-disk-writes"} and store.find("", P)[1] == 40 and store.writes == 1
    gen = generate(PrefixCache(tiny_engine, disk=DiskStore(tmp_path, ident)), P + [5], SP)
    assert gen.report.disk_loaded == 40 and gen.cached_tokens == 40
    failing = Snapshot(tuple(P[:7]), snap.k[:, :, :, :7], snap.v[:, :, :, :7], {}, salt="")
    store.put(failing)
    store.drain()
    assert store.entries[store.name_of("", P[:7])].failed
    gone = Snapshot(tuple(P[:9]), snap.k[:, :, :, :9], snap.v[:, :, :, :9], {}, salt="")
    gate.clear()
    store.put(gone)
    assert store.forget("", P[:9])  # dropped while its write waits
    gate.set()
    store.drain()
    store.put(snap)  # any put purges the failed entry
    assert store.name_of("", P[:7]) not in store.entries and not (tmp_path / store.name_of("", P[:9])).exists()
    monkeypatch.setattr(disk_module, "QUEUE_BYTES", 0)  # the queue full: written on the caller's thread
    store.put(Snapshot(tuple(P[:11]), snap.k[:, :, :, :11], snap.v[:, :, :, :11], {}, salt=""))
    assert not store.entries[store.name_of("", P[:11])].pending and store.queued_bytes == 0
    assert (tmp_path / store.name_of("", P[:11])).exists()
