"""The command-line tools through subprocesses, on the real default model, bad input included."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real


def run(*args, timeout=300):
    """Run `python -m jaxsmol.cli.main ...` (or cli.aitest when args[0] == 'aitest')."""
    module = "jaxsmol.cli.aitest" if args[0] == "aitest" else "jaxsmol.cli.main"
    args = args[1:] if args[0] == "aitest" else args
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_lab_probe_reuses_prompt_n_minus_1():
    r = run("aitest", "--cacheprobe", "--predict", 1, 0, 1, 2, 3, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "single"
    assert out["cold"]["tokens_reused"] == 0 and out["cold"]["tokens_prefilled"] == 4
    assert out["warm"]["tokens_reused"] == 3 and out["warm"]["tokens_prefilled"] == 1
    assert out["identical"] is True
    assert out["warm"]["output_ids"] == out["cold"]["output_ids"] and len(out["warm"]["output_ids"]) == 1
    assert out["warm"]["snapshot_bytes"] == 3 * 46080  # float32 SmolLM2-135M: 46,080 bytes a position


def test_lab_probe_table_and_one_token_bypass():
    """The table, its first-run line (the one-time costs paid before the cold run, by a request of other
    tokens) and, for a 4-token prompt, why the cache saves little; a one-token prompt bypasses the cache."""
    r = run("aitest", "--cacheprobe", "--predict", 1, 0, 1, 2, 3)
    assert r.returncode == 0, r.stderr
    assert "tokens reused        0" in r.stdout and "identical outputs: yes" in r.stdout
    assert "first run, before the probe: " in r.stdout
    r = run("aitest", "--cacheprobe", "--predict", 1, 7, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for run_ in ("cold", "warm"):
        assert out[run_]["bypass"] == "prompt has at most one token"
        assert out[run_]["tokens_reused"] == 0
    assert out["first_run_s"] > 0


def test_the_probe_table_says_why_a_short_prompt_gains_little():
    from jaxsmol.cli.tables import format_probe

    run_ = {"prompt_tokens": 4, "tokens_reused": 0, "tokens_prefilled": 4, "bypass": None, "exact_hit": False,
            "ttft_s": 0.0087, "total_s": 0.0098, "output_ids": [198], "text": "\n", "snapshot_bytes": 1}
    result = {"mode": "single", "max_tokens": 1, "cold": run_, "identical": True, "first_run_s": 0.187,
              "warm": dict(run_, tokens_reused=3, tokens_prefilled=1)}
    short = format_probe(dict(result, ttft_speedup=1.0)).splitlines()
    assert short[-2] == "first run, before the probe: 187 ms (other tokens, cold then warm: one-time costs kept out " \
                        "of the cold run)"
    assert short[-1].startswith("a 4-token prompt leaves the cache little to save") and "--text" in short[-1]
    assert not format_probe(dict(result, ttft_speedup=23.0)).splitlines()[-1].startswith("a 4-token")


def test_cacheprobe_then_shares_only_a_prefix_radix():
    """(--speculate before the ids: an option the probe takes, not an id.)"""
    r = run("cacheprobe", "--speculate", "none", 1, 2, 3, 4, 5, 6, 7, 8, "--then", 1, 2, 3, 4, 9, 9, "--predict", 3,
            "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "radix"
    assert out["warm"]["tokens_reused"] == 4 and out["warm"]["tokens_prefilled"] == 2
    assert out["identical"] is True


def test_generate_chat_answers_paris():
    """The default (int8 under the kernels) and the exact class both answer this one (the README's example;
    "What is the capital of France?" is a near-tie that int8 answers as llama.cpp does, "L'Étoile, ...")."""
    r = run("generate", "--chat", "Name the capital city of France.", "--max-tokens", 16)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("The capital city of France is Paris.")
    r = run("generate", "--chat", "What is the capital of France?", "--max-tokens", 16, "--matmul", "exact")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("The capital of France is Paris.")
    assert "tok/s" in r.stderr  # the timing line


def test_generate_json_with_logprobs():
    r = run("generate", "--ids", 504, 3458, 282, 4649, 314, "--max-tokens", 3, "--logprobs", 2, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == [504, 3458, 282, 4649, 314]
    assert len(out["output_ids"]) == 3 and len(out["logprobs"]) == 3
    assert all(len(p["top"]) == 2 for p in out["logprobs"])
    assert out["logprobs"][0]["top"][0]["id"] == out["output_ids"][0]  # greedy picks the top token
    assert {"ttft_s", "prefill_tok_s", "decode_tok_s"} <= set(out["timings"])


def test_tokenize():
    r = run("tokenize", "Hello 123", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"][-3:] == ["1", "2", "3"]  # digits are split one by one


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--model", "/nonexistent/model"), "does not exist"),
    (("generate", "--ids", 1, 999999, "--max-tokens", 1), "outside [0, 49152)"),
    (("generate", "", "--max-tokens", 1), "prompt is empty"),
    (("generate", "hi", "--max-tokens", -1), "max_tokens must be >= 0"),
    (("generate", "hi", "--max-tokens", 100, "--ctx", 50), "exceeds the context of 50 tokens"),
    (("generate", "hi", "--ctx", 10**6), "context length 1000000 must be in"),
    (("generate", "hi", "--temperature", -1), "temperature must be >= 0"),
    (("aitest", "--predict", -1, 1, 2), "--predict must be >= 0"),
    (("aitest", "--cacheprobe", "--predict", 1, -5), "outside [0, 49152)"),
    (("generate", "--bogus"), "unrecognized arguments"),
    (("cacheprobe", "--speculate", "draft", 1, 2), "argument --speculate: invalid choice: 'draft'"),
    (("aitest", "--url", "http://127.0.0.1:9", "--speculate", "none", 1, 2), "the daemon's own --speculate"),
    (("serve", "--max-batch", 0), "--max-batch must be in [1, 256], got 0"),
    (("serve", "--prefill-chunk", 100), "--prefill-chunk must be one of 32, 48, 64, 128, 256, 512, got 100"),
])
def test_bad_input_is_one_clear_line(args, message):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr


def test_model_dir_lacking_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    r = run("generate", "hi", "--model", tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ")


def test_import_gguf_refuses_a_non_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = run("import-gguf", bad, tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "model.gguf" in r.stderr
    assert not (tmp_path / "out").exists()


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"jaxsmol {version('jaxsmol')}"
