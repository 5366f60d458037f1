"""The forward sharded over a JAX mesh (4 CPU devices forced by XLA_FLAGS, in subprocesses, since
the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}


def run_py(code: str, timeout=600) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


TINY = """
import json, numpy as np, jax
from jaxsmol.model.config import Config
from jaxsmol.model.params import init_random
from jaxsmol.runtime.engine import Engine
from jaxsmol.model.sharding import make_mesh
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import generate
cfg = Config.tiny(n_heads=8, n_kv_heads=4)
params = init_random(cfg)
single = Engine(cfg, params, None, ctx=1024)
prompt = [int(t) for t in np.random.default_rng(0).integers(3, 256, 300)]
sp = SamplingParams(max_tokens=6, logprobs=3)
ref = generate(single, prompt, sp)
out = {"devices": len(jax.devices()), "layouts": {}}
for tp, dp in [(4, 1), (2, 2), (1, 4)]:
    eng = Engine(cfg, params, None, ctx=1024, mesh=make_mesh(tp=tp, dp=dp))
    cold = generate(eng, prompt, sp)
    cache = PrefixCache(eng)
    generate(cache, prompt[:200] + [5, 6], sp)          # a stored prefix of 200 tokens
    warm = generate(cache, prompt, sp)
    report = warm.report
    out["layouts"][f"tp{tp}dp{dp}"] = {
        "max_abs_diff_vs_single": float(np.abs(cold.prompt_logits - ref.prompt_logits).max()),
        "same_tokens_as_single": cold.output_ids == ref.output_ids,
        "reused": report.reused,
        "warm_equals_cold_bitwise": bool(np.array_equal(warm.prompt_logits, cold.prompt_logits))
                                    and warm.output_ids == cold.output_ids and warm.logprobs == cold.logprobs,
        "wq_spec": str(eng.params.layers.wq.sharding.spec),
        "kv_spec": str(eng.new_cache(64).k.sharding.spec),
        "fingerprint_differs": eng.fingerprint != single.fingerprint,
        "cpu_kernels": eng.cfg.cpu_kernels,
    }
# a host snapshot has no layout: a state taken on a 4-way mesh is placed on one device, and back
eng = Engine(cfg, params, None, ctx=1024, mesh=make_mesh(tp=4))
_, kv = eng.prefill(prompt, eng.new_cache(512))
snap = kv.trim(300)
moved = single.restore(snap, 512)
out["resharded_snapshot_equal"] = bool(np.array_equal(np.asarray(moved.k)[:, :, :, :300], snap.k))
out["resharded_snapshot_single_device"] = len(moved.k.sharding.device_set) == 1
print(json.dumps(out))
"""


def test_sharded_forward_matches_single_device_and_cache_stays_exact():
    out = run_py(TINY)
    assert out["devices"] == 4
    for name, r in out["layouts"].items():
        # Sharded matmuls sum partial products across devices in another order than one device
        # does, so the last bits differ (float32 rounding, ~1e-6 here); greedy tokens are the same.
        assert r["max_abs_diff_vs_single"] < 1e-4, name
        assert r["same_tokens_as_single"], name
        assert r["reused"] == 200 and r["warm_equals_cold_bitwise"], name  # cached == uncached holds
        assert r["fingerprint_differs"], name  # caches never mix states of different layouts
        assert not r["cpu_kernels"], name  # GSPMD cannot partition the C++ kernels
    assert out["layouts"]["tp4dp1"]["wq_spec"].endswith("(None, None, 'model')")  # Q columns split 4 ways
    assert out["layouts"]["tp4dp1"]["kv_spec"].endswith("'model', None, None)")  # kv heads split
    assert "'model'" in out["layouts"]["tp2dp2"]["wq_spec"]
    assert out["resharded_snapshot_equal"] and out["resharded_snapshot_single_device"]


@pytest.mark.real
def test_real_model_tensor_parallel_over_3_devices():
    # SmolLM2-135M has 9 query and 3 key/value heads: tp=3 splits every head group evenly.
    out = run_py("""
    import json, numpy as np
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.sharding import make_mesh
    from jaxsmol.runtime.sampling import SamplingParams
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import generate
    single = Engine.load(ctx=2048, quantize="none", progress=False)  # float32: a mesh splits float matrices
    tp = Engine(single.cfg, single.params, single.tokenizer, ctx=2048, mesh=make_mesh(tp=3))
    tok = single.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    sp = SamplingParams(max_tokens=10)
    a, b = generate(single, ids, sp), generate(tp, ids, sp)
    cache = PrefixCache(tp)
    generate(cache, ids[:-3], sp)
    warm = generate(cache, ids, sp)
    report = warm.report
    print(json.dumps({"single": a.text, "tp": b.text, "diff": float(np.abs(a.prompt_logits - b.prompt_logits).max()),
                      "reused": report.reused, "exact": bool(np.array_equal(warm.prompt_logits, b.prompt_logits)),
                      "wk_spec": str(tp.params.layers.wk.sharding.spec)}))
    """)
    assert out["tp"] == out["single"] and out["tp"].startswith("The capital of France is Paris.")
    assert out["diff"] < 1e-3
    assert out["reused"] > 0 and out["exact"]
    assert "model" in out["wk_spec"]


def test_cli_refuses_a_mesh_larger_than_the_devices():
    r = subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "generate", "hi", "--tp", "8"], capture_output=True,
                       text=True, timeout=300, env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "needs 8 devices, but only 4 are visible" in r.stderr


@pytest.mark.real
def test_daemon_serves_with_a_mesh(tmp_path, tiny_model_dir):
    """`jaxsmol serve --tp 2` on the two-layer checkpoint (the real model's sharded answers are checked in
    process above): its greedy tokens equal one device's, and a repeated prompt is served from the cache."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxsmol.cli.main", "serve", "--port", str(port), "--ctx", "1024",
                             "--model", str(tiny_model_dir), "--tp", "2"],
                            stdout=log, stderr=subprocess.STDOUT, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        prompt = "The capital of France is"
        body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
                           "ignore_eos": True}).encode()
        answers = []
        for _ in range(2):
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            answers.append(json.loads(urllib.request.urlopen(req, timeout=300).read()))
        from jaxsmol.cache.scheduler.many import generate
        from jaxsmol.runtime.engine import Engine
        from jaxsmol.runtime.sampling import SamplingParams

        single = Engine.load(tiny_model_dir, ctx=1024, progress=False)
        alone = generate(single, single.tokenizer.encode(prompt), SamplingParams(max_tokens=4, ignore_eos=True))
        assert answers[0]["choices"][0]["token_ids"] == alone.output_ids
        assert answers[1]["choices"][0]["token_ids"] == answers[0]["choices"][0]["token_ids"]
        assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=120)
