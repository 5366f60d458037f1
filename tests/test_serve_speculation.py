"""Speculation through the daemon (its default, --speculate auto): the token ids and logprobs of every
request, alone and under 8 concurrent clients, greedy and sampled, equal plain decoding's in the library
(`speculate="none"`), bit for bit; and /metrics counts the drafts by source. On the two-layer checkpoint
(its random weights loop on a repeating prompt, so drafts are accepted)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from daemon import Server, assert_healthy, metrics, post

C = "/v1/completions"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir):
    server = Server("--model", str(tiny_model_dir), "--max-batch", "8").wait_ready()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from jaxsmol.runtime.engine import Engine

    return Engine.load(tiny_model_dir, ctx=2048, progress=False)


def requests_(n: int, seed: int, recurring: bool = True) -> list[dict]:
    """n prompts, a random 8 tokens three times and a bit (n-gram drafts recur), or 27 random tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(100, 20000, 8 if recurring else 27).tolist()
        sampled = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
        out.append({"prompt": base * 3 + base[:3] if recurring else base, "max_tokens": 24, "logprobs": 2,
                    "return_token_ids": True, "ignore_eos": True, **sampled})
    return out


def plain(engine, body: dict) -> tuple:
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.runtime.sampling import SamplingParams

    sp = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed", 0),
                        logprobs=2, ignore_eos=True)
    r = generate(engine, body["prompt"], sp, speculate="none")
    return r.output_ids, [p["logprob"] for p in r.logprobs]


def answer(url: str, body: dict) -> tuple:
    r = post(url, C, body, timeout=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def accepted(url: str, source: str) -> float:
    return metrics(url)[f'jaxsmol_speculation_accepted_tokens_total{{source="{source}"}}']


def answers_as_plain(url: str, engine, seed: int, least: int, source: str, most: int = 6,
                     recurring: bool = True) -> None:
    """Rounds of 8 concurrent requests and one alone (at least `least`, until the daemon has accepted drafts
    from `source`): every answer equals plain decoding's."""
    rounds = 0
    while rounds < least or accepted(url, source) == 0:
        assert rounds < most, "the daemon never accepted a draft"
        bodies = requests_(8, seed=seed + rounds, recurring=recurring)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda b: answer(url, b), bodies))
        for body, got in zip(bodies, answers):
            assert got == plain(engine, body), body
        alone = requests_(1, seed=seed + 100 + rounds, recurring=recurring)[0]
        assert answer(url, alone) == plain(engine, alone)
        rounds += 1


def test_speculating_daemon_answers_as_plain_decoding(daemon, engine):
    """Rounds of 8 concurrent requests and one alone, until the daemon has accepted drafts (its verify
    steps compile in the background at first): every answer equals plain decoding's."""
    answers_as_plain(daemon, engine, seed=0, least=2, source="ngram")
    m = metrics(daemon)
    for source in ("cache", "ngram", "grammar"):
        drafted = m[f'jaxsmol_speculation_drafted_tokens_total{{source="{source}"}}']
        assert 0 <= m[f'jaxsmol_speculation_accepted_tokens_total{{source="{source}"}}'] <= drafted
    assert m['jaxsmol_speculation_accepted_tokens_total{source="ngram"}'] > 0
    assert_healthy(daemon)


def deepened(src, out, layers: int = 16, intermediate: int = 8192):
    """The checkpoint at `src` as a target that its own weights predict, at ~8x their bytes: its MLPs
    widened with zeros, and layers added whose attention and MLP outputs are zero (their residual
    adds nothing), so the draft's greedy tokens are nearly always the target's."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    small = load_file(src / "model.safetensors")
    hidden, width = cfg["hidden_size"], cfg["intermediate_size"]
    rng = np.random.default_rng(0)
    tensors = {k: v for k, v in small.items() if ".layers." not in k}

    def w(i: int, name: str, shape):  # layer i's tensor: the small model's for its layers, random (unused) after
        key = f"model.layers.{i}.{name}.weight"
        return small[key] if key in small else (
            np.ones(shape, np.float32) if "norm" in name else rng.standard_normal(shape).astype(np.float32))

    for i in range(layers):
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj"):
            tensors[f"model.layers.{i}.{name}.weight"] = w(i, name, small[f"model.layers.0.{name}.weight"].shape)
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"] = (
            w(i, "self_attn.o_proj", None) if i < cfg["num_hidden_layers"] else np.zeros((hidden, hidden), np.float32))
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            wide = np.zeros((intermediate, hidden), np.float32)
            wide[:width] = w(i, name, (width, hidden))
            tensors[f"model.layers.{i}.{name}.weight"] = wide
        down = np.zeros((hidden, intermediate), np.float32)
        if i < cfg["num_hidden_layers"]:
            down[:, :width] = small[f"model.layers.{i}.mlp.down_proj.weight"]
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = down
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers, intermediate_size=intermediate)))
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def deep_model_dir(tiny_model_dir, tmp_path_factory):
    return deepened(tiny_model_dir, tmp_path_factory.mktemp("deep-model"))


@pytest.fixture(scope="module")
def deep_engine(deep_model_dir):
    from jaxsmol.runtime.engine import Engine

    return Engine.load(deep_model_dir, ctx=2048, progress=False)


@pytest.fixture(scope="module")
def drafting_daemon(deep_model_dir, tiny_model_dir):
    server = Server("--model", str(deep_model_dir), "--max-batch", "8", "--draft-model", str(tiny_model_dir))
    server.wait_ready()
    yield server.url
    server.stop()


def test_draft_model_daemon_answers_as_plain_decoding(drafting_daemon, deep_engine):
    """--draft-model (a target its draft predicts, at ~8x the draft's bytes: drafting pays): 8 concurrent
    requests and one alone equal plain decoding's, and /metrics counts the draft model's drafts."""
    answers_as_plain(drafting_daemon, deep_engine, seed=50, least=3, source="draft", recurring=False)
    m = metrics(drafting_daemon)
    assert m['jaxsmol_speculation_accepted_tokens_total{source="draft"}'] > 0
    assert m["jaxsmol_batch_draft_cache_bytes"] > 0  # the prompts' draft states, stored
    assert post(drafting_daemon, "/v1/cache/flush", {}).status_code == 200
    assert metrics(drafting_daemon)["jaxsmol_batch_draft_cache_bytes"] == 0  # a flush forgets them too
    assert_healthy(drafting_daemon)
