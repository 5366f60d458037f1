"""Prefix snapshots on disk (cache/store/snapshot.py, cache/store/disk.py): the file format, its refusals and
atomic writes; the daemon's second tier and --prompt-cache across processes are in
tests/test_disk_tier.py.

Most tests use the tiny engine (fingerprint "tiny", no tokenizer); the one marked `real` checks the
bundled model's tokenizer fingerprint.
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxsmol.cache.store import snapshot
from jaxsmol.cache.store.disk import DiskStore, load_prompt_cache, save_prompt_cache
from jaxsmol.cache.store.snapshot import Snapshot, SnapshotError, load_snapshot
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import generate
from cache_runs import toks
from daemon import ROOT
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams

SP = SamplingParams(max_tokens=4)
TINY = {"model": "tiny", "tokenizer": "none"}


@pytest.fixture(scope="module")
def saved(tiny_engine, tmp_path_factory):
    """A prompt-cache file of P (90 tokens) + its 4 generated tokens, and the cold generation of P."""
    P = toks(90, 1)
    cache = PrefixCache(tiny_engine)
    gen = generate(cache, P, SP)
    path = tmp_path_factory.mktemp("snap") / "p.safetensors"
    assert save_prompt_cache(cache, path, P + gen.output_ids) == len(P) + len(gen.output_ids)
    return path, P, gen


# ---- round trip -----------------------------------------------------------------------------------------
def test_round_trip_is_bitwise(tiny_engine, saved):
    path, P, cold_P = saved
    snap = load_snapshot(path, snapshot.identity(tiny_engine), P)
    assert snap.tokens == tuple(P + cold_P.output_ids) and sorted(snap.logits) == [90, 94]
    assert not snap.k.flags.writeable and snap.k.dtype == np.float32
    assert np.array_equal(snap.logits[90], cold_P.prompt_logits)

    # the same prompt from a loaded file: an exact hit (no forward), the cold run's tokens
    cache = PrefixCache(tiny_engine)
    assert load_prompt_cache(cache, path, P).loaded == 94
    gen = generate(cache, P, SP)
    report = gen.report
    assert report.exact_hit and report.reused == 90
    assert gen.output_ids == cold_P.output_ids and np.array_equal(gen.prompt_logits, cold_P.prompt_logits)

    # a longer prompt sharing P: P reused from the file, the rest prefilled, bits of a cold run
    Q = P + toks(20, 2)
    cache = PrefixCache(tiny_engine)
    load_prompt_cache(cache, path, Q)
    gen = generate(cache, Q, SP)
    report = gen.report
    cold = generate(tiny_engine, Q, SP)
    assert report.reused == 90 and report.prefilled == 20
    assert np.array_equal(gen.prompt_logits, cold.prompt_logits) and gen.output_ids == cold.output_ids


def test_partial_prefix_and_bfloat16_round_trip(tiny_engine, saved, tmp_path):
    import ml_dtypes

    path, P, _ = saved
    R = P[:50] + toks(10, 3)  # shares only 50 tokens with the file
    cache = PrefixCache(tiny_engine)
    load_prompt_cache(cache, path, R)
    gen = generate(cache, R, SP)
    report = gen.report
    cold = generate(tiny_engine, R, SP)
    assert report.reused == 50 and np.array_equal(gen.prompt_logits, cold.prompt_logits)

    k = np.arange(2 * 1 * 2 * 3 * 4, dtype=np.float32).reshape(2, 1, 2, 3, 4).astype(ml_dtypes.bfloat16)
    snap = Snapshot((5, 6, 7), k, -k, {3: np.ones(8, np.float32)}, salt="tenant")
    snapshot.save_snapshot(tmp_path / "b.safetensors", snap, TINY)
    back = load_snapshot(tmp_path / "b.safetensors", TINY)
    assert back.k.dtype == k.dtype and np.array_equal(back.k.view(np.uint16), k.view(np.uint16))
    assert back.salt == "tenant" and back.tokens == (5, 6, 7) and np.array_equal(back.logits[3], np.ones(8))


# ---- refusals -------------------------------------------------------------------------------------------
def _flip(p: Path, at: int) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= 0x01
    p.write_bytes(bytes(b))


def _case(name: str, src: Path, dst: Path, P: list[int], monkeypatch):
    """Make the broken file of case `name` at dst; return (prompt, words the refusal must contain)."""
    prompt = P
    data = src.read_bytes()
    dst.write_bytes(data)
    if name == "other model":
        snapshot.save_snapshot(dst, load_snapshot(src, TINY), {**TINY, "model": "another"})
        words = "another model"
    elif name == "other tokenizer":
        snapshot.save_snapshot(dst, load_snapshot(src, TINY), {**TINY, "tokenizer": "0123456789abcdef"})
        words = "another tokenizer"
    elif name == "flipped byte":
        _flip(dst, len(data) - 1000)  # inside the tensor bytes
        words = "corrupted"
    elif name == "flipped header byte":
        header = data[8:8 + int.from_bytes(data[:8], "little")]
        first_id_end = header.index(b",", header.index(b'"tokens'))  # just after the first token id
        _flip(dst, 8 + first_id_end - 1)  # its last digit: still valid JSON, another token id
        words = "corrupted"
    elif name == "truncated":
        dst.write_bytes(data[: len(data) // 2])
        words = "truncated"
    elif name == "wrong version":
        snap = load_snapshot(src, TINY)
        monkeypatch.setattr(snapshot, "FORMAT_VERSION", 99)
        snapshot.save_snapshot(dst, snap, TINY)
        monkeypatch.undo()
        words = "format version 99"
    elif name == "foreign tokens":
        prompt = [t + 1 if t < 255 else 3 for t in P]  # shares no prefix
        words = "share no prefix"
    elif name == "not a snapshot":
        from safetensors.numpy import save_file
        save_file({"x": np.zeros(3, np.float32)}, dst)
        words = "not a jaxsmol prefix snapshot"
    return prompt, words


CASES = ["other model", "other tokenizer", "flipped byte", "flipped header byte", "truncated", "wrong version",
         "foreign tokens", "not a snapshot"]


def test_refusals_then_the_cold_path_answers(tiny_engine, saved, tmp_path, monkeypatch):
    src, P, cold = saved
    for name in CASES:
        dst = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        prompt, words = _case(name, src, dst, P, monkeypatch)
        with pytest.raises(SnapshotError, match=words) as err:
            load_snapshot(dst, TINY, prompt)
        assert isinstance(err.value, JaxsmolError) and "\n" not in str(err.value), name
        cache = PrefixCache(tiny_engine)  # through the prompt cache: reported, then cold and correct
        report = load_prompt_cache(cache, dst, prompt)
        assert report.refused and words in report.refused and report.loaded == 0, name
        if prompt == P:
            gen = generate(cache, P, SP)
            r = gen.report
            assert r.reused == 0 and gen.output_ids == cold.output_ids, name
    # a missing file is no refusal: nothing to load
    assert load_prompt_cache(PrefixCache(tiny_engine), tmp_path / "absent", P).refused is None


def _rewrite_manifest(path: Path, **changes) -> None:
    """Change manifest fields of a snapshot file and re-sign it with a valid checksum (the algorithm the
    format documents), as a crafted file would be."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(path, framework="np") as f:
        manifest = json.loads(f.metadata()["jaxsmol"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    manifest.update(changes)
    manifest["checksum"] = snapshot.checksum(manifest, tensors)
    save_file(tensors, path, metadata={"jaxsmol": json.dumps(manifest)})


def test_dims_and_dtypes_are_checked_against_the_engine(tiny_engine, saved, tmp_path):
    """A file may carry this model's fingerprint (it is no secret) and arrays the engine cannot use."""
    src, P, _ = saved
    ident = snapshot.identity(tiny_engine)
    good = load_snapshot(src, ident)
    k = np.asarray(good.k)
    cases = {
        "other layers": (Snapshot(good.tokens, k[:1], k[:1]), "this engine needs float32 [2, 1, 2, 94, 16]"),
        "other dtype": (Snapshot(good.tokens, k.astype(np.float16), k.astype(np.float16)), "float16"),
        "other vocab": (Snapshot(good.tokens, k, k, {90: np.zeros(7, np.float32)}), "float32 [256]"),
        "logits dtype": (Snapshot(good.tokens, k, k, {90: np.zeros(256, np.float64)}), "logits float64"),
    }
    for name, (snap, words) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        snapshot.save_snapshot(path, snap, TINY)  # the right fingerprint, the wrong arrays
        with pytest.raises(SnapshotError, match=re.escape(words)):
            load_snapshot(path, ident)
    # an unknown dtype name is a refusal too, at daemon start as well (it was an AttributeError)
    path = tmp_path / ("0" * 32 + ".safetensors")
    path.write_bytes(src.read_bytes())
    for bad in ("no_such_dtype", "__class__", ["f4"], 3):
        _rewrite_manifest(path, dtypes={"k": bad, "v": "float32", "logits": "float32"})
        with pytest.raises(SnapshotError, match="malformed"):
            load_snapshot(path, ident)
    odd = tmp_path / ("3" * 32 + ".safetensors")  # a manifest whose tokens are not a list of ids
    odd.write_bytes(src.read_bytes())
    _rewrite_manifest(odd, tokens=None)
    store = DiskStore(tmp_path, ident)  # the directory scan skips it rather than failing
    assert [name for name, _ in store.skipped] == [odd.name] and list(store.entries) == [path.name]
    cache = PrefixCache(tiny_engine, disk=store)
    assert cache.warm_from_disk() == 0 and cache.stats.disk_refused == {"corrupted": 1}


def test_size_cap_is_checked_before_reading(tiny_engine, tmp_path):
    ident = snapshot.identity(tiny_engine)
    cap = snapshot.max_snapshot_bytes(tiny_engine)
    assert ident["max_bytes"] == cap == 1024 * (tiny_engine.kv_bytes_per_token + 16) + 64 * 4 * 256 + (1 << 20)
    # the largest snapshot the engine can make fits: ctx tokens, more logits rows than a file keeps
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 1, 2, 1024, 16)).astype(np.float32)
    logits = {n: rng.standard_normal(256).astype(np.float32) for n in range(1, 1025, 10)}  # 103 rows
    path = tmp_path / ("1" * 32 + ".safetensors")
    size = snapshot.save_snapshot(path, Snapshot(tuple(range(3, 1027)), k, k, logits), ident)
    assert size <= cap
    back = load_snapshot(path, ident)
    assert sorted(back.logits) == sorted(logits)[-snapshot.MAX_LOGITS_ROWS:]  # the longest prefixes' kept
    # one byte over the cap: refused from its size alone (a sparse file: nothing in it parses)
    big = tmp_path / ("2" * 32 + ".safetensors")
    with open(big, "wb") as f:
        f.truncate(cap + 1)
    with pytest.raises(SnapshotError, match=f"is {cap + 1} bytes, more than this engine could have written"):
        load_snapshot(big, ident)
    store = DiskStore(tmp_path, ident)  # not indexed, not deleted (another engine may have written it)
    assert list(store.entries) == [path.name] and big.exists()
    assert [name for name, _ in store.skipped] == [big.name]


def test_snapshot_files_are_private(saved, tmp_path):
    src, _, _ = saved
    old = os.umask(0)  # even with the most permissive umask
    try:
        size = snapshot.save_snapshot(tmp_path / "p.safetensors", load_snapshot(src, TINY), TINY)
    finally:
        os.umask(old)
    assert size > 0 and (tmp_path / "p.safetensors").stat().st_mode & 0o777 == 0o600


def test_a_file_that_is_not_a_snapshot_is_never_overwritten(tiny_engine, saved, tmp_path):
    from safetensors.numpy import save_file

    src, P, _ = saved
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes: not to be lost to a typo\n")
    weights = tmp_path / "model.safetensors"
    save_file({"x": np.arange(3, dtype=np.float32)}, weights)
    folder = tmp_path / "folder"
    folder.mkdir()
    for path in (notes, weights, folder):
        before = path.read_bytes() if path.is_file() else None
        cache = PrefixCache(tiny_engine)
        report = load_prompt_cache(cache, path, P)
        assert report.foreign and "left as it is (not overwritten)" in report.refused, path
        gen = generate(cache, P, SP)
        assert save_prompt_cache(cache, path, P + gen.output_ids, report) == 0
        with pytest.raises(SnapshotError, match="refusing to overwrite"):  # without the report: checked again
            save_prompt_cache(cache, path, P + gen.output_ids)
        assert (path.read_bytes() if path.is_file() else None) == before and path.is_file() == (path != folder)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "model.safetensors", "notes.txt"]
    # a refused file that is a snapshot (another model's, truncated data) is replaced by this one's
    data = src.read_bytes()
    for broken in (data[: len(data) // 2], None):
        ours = tmp_path / "ours.safetensors"
        if broken is None:
            snapshot.save_snapshot(ours, load_snapshot(src, TINY), {**TINY, "model": "another"})
        else:
            ours.write_bytes(broken)
        cache = PrefixCache(tiny_engine)
        report = load_prompt_cache(cache, ours, P)
        assert report.refused and not report.foreign
        gen = generate(cache, P, SP)
        assert save_prompt_cache(cache, ours, P + gen.output_ids, report) == len(P) + len(gen.output_ids)
        assert load_snapshot(ours, TINY, P).length == len(P) + len(gen.output_ids)


@pytest.mark.real
def test_tokenizer_fingerprint(model_dir, tmp_path):
    import shutil

    from jaxsmol.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    fp = tok.fingerprint
    assert fp == Tokenizer.load(model_dir).fingerprint and len(fp) == 32
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"] + " "
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.load(tmp_path).fingerprint != fp  # the chat template is part of it


# ---- atomic writes --------------------------------------------------------------------------------------
def test_failed_replace_leaves_the_old_file(saved, tmp_path, monkeypatch):
    src, P, _ = saved
    snap = load_snapshot(src, TINY)
    target = tmp_path / "p.safetensors"

    def boom(a, b):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        snapshot.save_snapshot(target, snap, TINY)
    assert not target.exists() and list(tmp_path.iterdir()) == []  # no file, no temporary left
    monkeypatch.undo()
    snapshot.save_snapshot(target, snap, TINY)
    monkeypatch.setattr(os, "replace", boom)
    other = Snapshot(snap.tokens[:10], snap.k[:, :, :, :10], snap.v[:, :, :, :10])
    with pytest.raises(OSError):
        snapshot.save_snapshot(target, other, TINY)
    monkeypatch.undo()
    assert load_snapshot(target, TINY).tokens == snap.tokens  # the old one, whole


_WRITER = """
import sys, numpy as np
from jaxsmol.cache.store.snapshot import Snapshot, save_snapshot
k = np.random.default_rng(0).standard_normal((8, 1, 4, 4096, 64)).astype(np.float32)  # 32 MiB a tensor
i = 0
while True:
    save_snapshot(sys.argv[1], Snapshot(tuple(range(i, i + 4096)), k, k), {"model": "m", "tokenizer": "none"})
    print(i, flush=True)
    i += 1
"""


def test_sigkill_mid_write_never_leaves_a_loadable_half_file(tmp_path):
    target = tmp_path / ("0" * 32 + ".safetensors")  # named like a DiskStore entry
    ident = {"model": "m", "tokenizer": "none"}
    for delay in (0.0, 0.15):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)], cwd=ROOT, stdout=subprocess.PIPE,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        try:
            assert proc.stdout.readline(), "the writer died before its first write"
            deadline = time.monotonic() + 60  # then kill it while a temporary file is being written
            while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.002)
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        snap = load_snapshot(target, ident)  # always a whole version
        assert snap.tokens == tuple(range(snap.tokens[0], snap.tokens[0] + 4096))
        store = DiskStore(tmp_path, ident)  # a directory scan ignores the temporary (half) file
        assert [e.path.name for e in store.entries.values()] == [target.name] and not store.skipped
    (tmp_path / "model.safetensors").write_bytes(b"not ours")  # a directory scan touches no other file
    assert len(DiskStore(tmp_path, ident)) == 1 and (tmp_path / "model.safetensors").exists()
