"""The prefix cache an operator steers, through the daemon's app in-process (Starlette's TestClient) on
the two-layer checkpoint with the real tokenizer: POST / DELETE /v1/cache/pin, GET /v1/cache, pins in a
tenant's namespace, pins across a restart through the disk tier, and `jaxsmol cache ls|rm|pin|unpin DIR`.
"""

from __future__ import annotations

import json

import pytest

from jaxsmol.cli.main import main as jaxsmol

pytestmark = pytest.mark.real  # the real tokenizer (from the bundled model), random two-layer weights

SYSTEM = ("You are a careful assistant. Answer in one short sentence, and say when you do not know. "
          "Examples: Q: What is the capital of France? A: Paris. Q: What is 2 + 2? A: 4.")


def complete(c, prompt, headers=None, **extra):
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_token_ids": True, **extra}
    r = c.post("/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def assert_exact(c, prompt, headers=None):
    """The prompt's answer, warm, has the bits of the same request with the prefix cache bypassed."""
    warm = complete(c, prompt, headers)
    cold = complete(c, prompt, headers, use_prefix_cache=False)
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    return warm["usage"]["prompt_tokens_details"]["cached_tokens"]


def entries(c, headers=None, **page) -> dict:
    r = c.get("/v1/cache", params=page, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_pinned_prompt_survives_lru_churn_and_is_restored_exactly(make_client, two_layer_engine):
    engine = two_layer_engine
    bpt, logits = engine.kv_bytes_per_token, 4 * engine.cfg.vocab_size  # 512 and 196,608 bytes here
    lru = 1_000_000  # a few prompts (each with its logits, and its answer's)
    c = make_client(cache_bytes=lru, pinned_bytes=300_000)
    r = c.post("/v1/cache/pin", json={"prompt": SYSTEM})
    assert r.status_code == 200, r.text
    pin = r.json()
    n = pin["tokens"]
    assert pin["pinned"] and n > 30 and pin["cached_tokens"] == 0 and pin["namespace"] == "default"
    assert pin["pinned_bytes"] == n * bpt + logits and pin["on_disk"] is False
    for i in range(6):  # other prompts through an LRU budget of a few of them
        complete(c, f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 6)
    listing = entries(c)
    assert listing["pinned_bytes"] == pin["pinned_bytes"] and listing["bytes"] - listing["pinned_bytes"] <= lru
    [pinned] = [e for e in listing["entries"] if e["pinned"]]
    assert pinned["key"] == pin["key"] and pinned["tokens"] == n
    assert assert_exact(c, SYSTEM + " Q: What colour is the sky? A:") >= n
    assert entries(c)["entries"][0]["bytes"] >= pinned["bytes"]  # the largest first
    # unpinned: back in the LRU, which the next prompts evict it from
    assert c.request("DELETE", "/v1/cache/pin", json={"prompt": SYSTEM}).json()["unpinned"]
    assert c.request("DELETE", "/v1/cache/pin", json={"prompt": SYSTEM}).status_code == 404
    for i in range(6):
        complete(c, f"Poem {i}: " + "roses are red and violets are blue " * 7)
    assert entries(c)["pinned_bytes"] == 0
    assert complete(c, SYSTEM)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_pins_are_refused_with_the_reason(make_client, two_layer_engine):
    c = make_client(pinned_bytes=100_000)  # less than one prompt's logits
    r = c.post("/v1/cache/pin", json={"prompt": SYSTEM})
    assert r.status_code == 400 and "--pinned-bytes" in r.json()["error"]["message"], r.text
    assert c.post("/v1/cache/pin", json={}).status_code == 400  # neither prompt nor messages
    assert c.post("/v1/cache/pin", json={"prompt": [two_layer_engine.cfg.vocab_size]}).status_code == 400
    assert c.request("DELETE", "/v1/cache/pin", json={"key": "0" * 32}).status_code == 404
    off = make_client(prefix_cache=False)
    r = off.post("/v1/cache/pin", json={"prompt": [5, 6, 7]})
    assert r.status_code == 400 and "radix" in r.json()["error"]["message"]
    for page in ({"limit": 0}, {"offset": -1}, {"limit": "x"}):
        assert c.get("/v1/cache", params=page).status_code == 400


def test_chat_messages_pin_the_prefix_later_chats_share(make_client):
    c = make_client()
    system = [{"role": "system", "content": SYSTEM}]
    pin = c.post("/v1/cache/pin", json={"messages": system}).json()
    chat = c.post("/v1/chat/completions", json={"messages": system + [{"role": "user", "content": "Hi there?"}],
                                                "max_tokens": 2, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= pin["tokens"] > 20
    # unpinned by the key GET /v1/cache gives
    r = c.request("DELETE", "/v1/cache/pin", json={"key": pin["key"]})
    assert r.status_code == 200 and r.json()["tokens"] == pin["tokens"]


def test_listing_pages_and_namespaces_with_api_keys(make_client, tmp_path):
    from jaxsmol.cli.server.tenants import Tenants

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-ops team-b admin\nsk-bob team-b\nsk-eve\n")
    c = make_client(tenants=Tenants.from_options(keys_file=str(keys)))
    ops, bob, eve = ({"Authorization": f"Bearer {k}"} for k in ("sk-ops", "sk-bob", "sk-eve"))
    assert c.post("/v1/cache/pin", json={"prompt": SYSTEM}, headers=bob).status_code == 403
    assert c.get("/v1/cache", headers=bob).status_code == 403
    assert c.get("/v1/cache").status_code == 401
    pin = c.post("/v1/cache/pin", json={"prompt": SYSTEM}, headers=ops).json()
    assert pin["namespace"] == "ns:team-b" and pin["cache_salt"] is None
    assert assert_exact(c, SYSTEM + " Q: Why?", bob) >= pin["tokens"]  # the team's namespace
    assert complete(c, SYSTEM + " Q: Why?", eve)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for i in range(5):
        complete(c, f"Note {i}: " + "a b c d " * (3 + i), eve)
    listing = entries(c, ops)
    spaces = {d["namespace"]: d for d in listing["namespaces"]}
    assert set(spaces) == {"ns:team-b", f"key:{next(iter(spaces.keys() - {'ns:team-b'}))[4:]}"}
    assert spaces["ns:team-b"]["pinned_bytes"] == listing["pinned_bytes"] > 0
    assert sum(d["entries"] for d in spaces.values()) == listing["total"] >= 7
    whole = entries(c, ops, limit=1000)["entries"]
    assert [e["bytes"] for e in whole] == sorted((e["bytes"] for e in whole), reverse=True)
    pages = [entries(c, ops, limit=3, offset=o)["entries"] for o in range(0, len(whole), 3)]
    assert [e["key"] for p in pages for e in p] == [e["key"] for e in whole]
    assert all(e["last_used"] > 0 and e["hits"] >= 0 for e in whole)


def test_pins_survive_a_restart_through_the_disk_tier_and_the_cache_command(make_client, two_layer_engine, tmp_path,
                                                                            capsys):
    d = tmp_path / "prefixes"
    c = make_client(cache_dir=d)
    pin = c.post("/v1/cache/pin", json={"prompt": SYSTEM, "cache_salt": "s1"}).json()
    assert pin["on_disk"] and pin["cache_salt"] == "s1"
    complete(c, "An ordinary prompt, stored and persisted at shutdown.")
    c.__exit__(None, None, None)  # shutdown: every entry written
    assert jaxsmol(["cache", "ls", str(d), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    by_key = {e["key"]: e for e in listed["entries"]}
    assert by_key[pin["key"]]["pinned"] and by_key[pin["key"]]["cache_salt"] == "s1"
    assert sum(e["pinned"] for e in listed["entries"]) == 1 and len(listed["entries"]) >= 2
    assert jaxsmol(["cache", "ls", str(d)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith(f"{d}: {len(listed['entries'])} entries")
    [row] = [line for line in table if line.startswith(pin["key"])]
    assert row.split()[1:3] == ["default", "s1"] and row.rstrip().endswith("yes")
    c2 = make_client(cache_dir=d)  # a restart: pinned again
    listing = entries(c2)
    [pinned] = [e for e in listing["entries"] if e["pinned"]]
    assert pinned["key"] == pin["key"] and listing["pinned_bytes"] > 0
    assert assert_exact(c2, SYSTEM + " Q: And then?", None) == 0  # another namespace: cache_salt s1
    c2.__exit__(None, None, None)
    assert jaxsmol(["cache", "unpin", str(d), pin["key"]]) == 0
    other = next(k for k, e in by_key.items() if not e["pinned"])
    assert jaxsmol(["cache", "rm", str(d), other]) == 0
    capsys.readouterr()
    c3 = make_client(cache_dir=d)
    assert entries(c3)["pinned_bytes"] == 0
    assert jaxsmol(["cache", "pin", str(d), "f" * 32]) == 2  # no such entry: one line, exit status 2
    assert "no entry" in capsys.readouterr().err
