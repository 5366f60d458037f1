"""tools/make_checkpoint.py writes a loadable checkpoint, and `jaxsmol generate` on it reports its
start-up (load, compile) apart from prefill and decode. A tiny config: the real sizes are benched,
not tested."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from make_checkpoint import SIZES, TINY, hf_config, make_checkpoint  # tools/, on the path via conftest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_dir):
    return make_checkpoint(TINY, tmp_path_factory.mktemp("ckpt"), dtype="bfloat16", tokenizer_dir=model_dir)


def test_real_sizes_have_the_published_shapes():
    assert hf_config("360M")["head_dim"] == 64 and hf_config("1.7B")["head_dim"] == 64
    assert SIZES["1.7B"]["num_key_value_heads"] == 32 and SIZES["360M"]["num_key_value_heads"] == 5


def test_written_checkpoint_loads_with_the_expected_shapes(tiny_dir):
    from jaxsmol.model.config import Config
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import Checkpoint, expected_shapes

    cfg = Config.load(tiny_dir)
    ckpt = Checkpoint(tiny_dir)
    assert {n: ckpt.shape(n) for n in ckpt.keys()} == expected_shapes(cfg)
    eng = Engine.load(tiny_dir, progress=False)
    assert eng.params.layers.wqkv.shape == (2, 4, 64, 32) and eng.tokenizer is not None
    norm = np.asarray(eng.params.final_norm)
    assert np.all(np.abs(norm - 1) < 1)  # norms near 1, stored as bfloat16, read back as float32


def _generate(model, programs, *extra):
    return subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "generate", "--model", str(model),
                           "--ids", "1", "2", "3", "--max-tokens", "4", *extra], capture_output=True, text=True,
                          timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXSMOL_COMPILE_CACHE": str(programs)})


def test_generate_reports_load_and_compile_apart(tiny_dir, tmp_path):
    # an empty program store of this test's own: the first run compiles every program (the session's
    # store may hold them), the second loads what the first stored (its summary line is the subject)
    programs = tmp_path / "programs"
    r = _generate(tiny_dir, programs, "--json")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["timings"]
    assert len(json.loads(r.stdout)["output_ids"]) == 4
    for key in ("load_s", "compile_s", "startup_s", "prefill_s", "decode_s", "total_s"):
        assert t[key] >= 0, key
    assert t["load_s"] > 0 and t["compile_s"] > 0  # the programs were compiled, in the background
    assert t["startup_s"] >= max(t["load_s"], t["compile_s"]) - 1e-6  # they overlap, both within start-up
    assert t["total_s"] >= t["prefill_s"] + t["decode_s"] - 1e-6
    r = _generate(tiny_dir, programs)
    assert r.returncode == 0, r.stderr
    summary = r.stderr.strip().splitlines()[-1]
    assert "load " in summary and "compile " in summary and "prefill " in summary and "decode " in summary
