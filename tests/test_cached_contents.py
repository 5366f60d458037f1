"""Named cached contents (/v1/cached_contents, Gemini's shape) and prompt_cache_retention, through the
daemon's app in-process on the two-layer checkpoint with the real tokenizer: created, listed, read,
their TTL changed, deleted, referenced by name from chat and completions with the bits of a cold run,
expiring on time, kept across a restart by the disk tier and listed by `jaxsmol cache ls`; each bad
request answered in Gemini's error shape naming the field; a 24h retention kept out of the disk LRU."""

from __future__ import annotations

import json
import time

import pytest

from jaxsmol.cli.main import main as jaxsmol

pytestmark = pytest.mark.real  # the real tokenizer (from the bundled model), random two-layer weights

SYSTEM = ("You are a careful assistant. Answer in one short sentence, and say when you do not know. "
          "Examples: Q: What is the capital of France? A: Paris. Q: What is 2 + 2? A: 4.")
CONTENT = {"system_instruction": {"parts": [{"text": SYSTEM}]},
           "contents": [{"role": "user", "parts": [{"text": "Here is a document: the sky is green."}]},
                        {"role": "model", "parts": [{"text": "Noted."}]}]}
AS_MESSAGES = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "Here is a document: the sky is green."},
               {"role": "assistant", "content": "Noted."}]
QUESTION = [{"role": "user", "content": "What colour is the sky?"}]


def create(c, headers=None, **body):
    r = c.post("/v1/cached_contents", json={**CONTENT, "ttl": "600s", **body}, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def chat(c, messages, headers=None, **extra):
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, **extra}
    return c.post("/v1/chat/completions", json=body, headers=headers or {})


def answer(r) -> tuple:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]


def gemini_error(r, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["status"] and all(w in err["message"] for w in words), err
    return err["message"]


def test_a_content_is_created_read_referenced_changed_and_deleted(make_client):
    c = make_client()
    made = create(c, display_name="sky doc")
    name, n = made["name"], made["usage_metadata"]["total_token_count"]
    assert name.startswith("cachedContents/") and made["display_name"] == "sky doc" and made["model"] == "tiny"
    assert n > 40 and made["expire_time"] > made["create_time"]
    assert c.get("/v1/cached_contents").json()["cached_contents"] == [made]
    assert c.get(f"/v1/cached_contents/{name}").json() == made
    assert c.get(f"/v1/cached_contents/{name.split('/')[1]}").json() == made  # the id alone too

    # the conversation after it: the content's positions restored, the bits of a cold run
    warm = chat(c, QUESTION, cached_content=name)
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert answer(warm) == answer(chat(c, AS_MESSAGES + QUESTION, use_prefix_cache=False))
    listing = c.get("/v1/cache").json()
    assert [e["names"] for e in listing["entries"] if e["pinned"]] == [[name]]

    later = c.patch(f"/v1/cached_contents/{name}", json={"ttl": "1200s"}).json()
    assert later["expire_time"] > made["expire_time"] and later["update_time"] >= made["update_time"]
    sooner = c.patch(f"/v1/cached_contents/{name}", json={"expireTime": made["create_time"][:-5] + "Z"})
    gemini_error(sooner, 400, "expire_time", "1 s to")
    assert c.delete(f"/v1/cached_contents/{name}").json() == {}
    gemini_error(c.get(f"/v1/cached_contents/{name}"), 404, name)
    assert c.get("/v1/cache").json()["pinned_bytes"] == 0
    r = chat(c, QUESTION, cached_content=name)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cached_content"


def test_a_prompt_content_prefixes_completions_and_expires_on_time(make_client):
    c = make_client()
    made = create(c, contents=None, system_instruction=None, prompt=SYSTEM, ttl=1.5)
    n = made["usage_metadata"]["total_token_count"]
    body = {"prompt": " Q: What is 3 + 3? A:", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    warm = c.post("/v1/completions", json={**body, "cached_content": made["name"]}).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert warm["usage"]["prompt_tokens"] > n
    r = chat(c, QUESTION, cached_content=made["name"])  # a prompt is not messages
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]
    time.sleep(1.7)
    gemini_error(c.get(f"/v1/cached_contents/{made['name']}"), 404)
    assert c.get("/v1/cached_contents").json() == {"cached_contents": []}
    assert c.get("/v1/cache").json()["pinned_bytes"] == 0


@pytest.mark.parametrize("body,where", [
    ({"contents": None}, "contents"),
    ({"prompt": "hi"}, "one of contents"),
    ({"ttl": "5m"}, "ttl"),
    ({"ttl": "0.5s"}, "ttl"),
    ({"ttl": 8 * 86400}, "ttl"),
    ({"ttl": "60s", "expire_time": "2030-01-01T00:00:00Z"}, "not both"),
    ({"ttl": None, "expire_time": "tomorrow"}, "expire_time"),
    ({"ttl": None, "expire_time": "2030-01-01T00:00:00"}, "time zone"),
    ({"contents": [{"role": "robot", "parts": [{"text": "x"}]}]}, "contents.0.role"),
    ({"contents": [{"role": "user", "parts": [{"image": "x"}]}]}, "contents.0.parts.0"),
    ({"contents": [{"role": "user", "parts": []}]}, "contents.0.parts"),
])
def test_bad_contents_are_refused_in_geminis_shape_naming_the_field(make_client, body, where):
    c = make_client()
    gemini_error(c.post("/v1/cached_contents", json={**CONTENT, "ttl": "60s", **body}), 400, where)


def test_a_name_is_its_tenants_and_its_namespace_is_kept(make_client, tmp_path):
    from jaxsmol.cli.server.tenants import Tenants

    keys = tmp_path / "keys.json"
    keys.write_text("a-key alice\nb-key bob\n")
    c = make_client(tenants=Tenants.from_options(keys_file=str(keys)))
    alice, bob = {"Authorization": "Bearer a-key"}, {"x-api-key": "b-key"}
    made = create(c, alice, cache_salt="docs")
    gemini_error(c.get(f"/v1/cached_contents/{made['name']}", headers=bob), 404)
    gemini_error(c.delete(f"/v1/cached_contents/{made['name']}", headers=bob), 404)
    assert c.get("/v1/cached_contents", headers=bob).json() == {"cached_contents": []}
    r = chat(c, QUESTION, bob, cached_content=made["name"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "cached_content"
    r = chat(c, QUESTION, alice, cached_content=made["name"], cache_salt="other")
    assert r.status_code == 400 and "cache namespace" in r.json()["error"]["message"]
    warm = chat(c, QUESTION, alice, cached_content=made["name"])  # its cache_salt taken from the content
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == made["usage_metadata"]["total_token_count"]
    gemini_error(c.get("/v1/cached_contents"), 401)


def test_a_content_survives_a_restart_and_cache_ls_names_it(make_client, tmp_path, capsys):
    d = str(tmp_path / "tier")
    c = make_client(cache_dir=d)
    made = create(c)
    c.__exit__(None, None, None)
    assert jaxsmol(["cache", "ls", d, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    named = [r for r in rows if r["name"] == made["name"]]
    assert len(named) == 1 and named[0]["pinned"] and named[0]["expires_at"] > time.time() + 500
    assert jaxsmol(["cache", "ls", d]) == 0
    assert made["name"] in capsys.readouterr().out
    c2 = make_client(cache_dir=d)
    again = c2.get(f"/v1/cached_contents/{made['name']}").json()
    assert again["name"] == made["name"] and abs(json_time(again["expire_time"]) - json_time(made["expire_time"])) < 2
    warm = chat(c2, QUESTION, cached_content=made["name"])
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == made["usage_metadata"]["total_token_count"]
    assert c2.delete(f"/v1/cached_contents/{made['name']}").status_code == 200
    c2.__exit__(None, None, None)
    assert jaxsmol(["cache", "ls", d, "--json"]) == 0
    assert not [r for r in json.loads(capsys.readouterr().out)["entries"] if r["name"]]


def json_time(s: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def test_a_24h_retention_keeps_the_prompt_on_disk_out_of_the_lru(make_client, two_layer_engine, tmp_path):
    from jaxsmol.cache.store.disk import list_dir

    d = tmp_path / "tier"
    per_prompt = 60 * two_layer_engine.kv_bytes_per_token + 4 * two_layer_engine.cfg.vocab_size
    # room in memory for about one prompt (others spill to disk), on disk for about three
    c = make_client(cache_dir=str(d), cache_bytes=int(1.5 * per_prompt), disk_cache_bytes=3 * per_prompt)
    kept = SYSTEM + " Q: Which one do we keep? A:"
    body = {"prompt": kept, "max_tokens": 1, "temperature": 0}
    assert c.post("/v1/completions", json={**body, "prompt_cache_retention": "24h"}).status_code == 200
    for _ in range(200):  # the file is written on the disk tier's writer thread, after the answer
        retained = [e for e in list_dir(d)[0] if e.expires_at]
        if retained:
            break
        time.sleep(0.05)
    [entry] = retained
    assert not entry.pinned and 86000 < entry.expires_at - time.time() <= 86400
    for i in range(8):  # spills churn the disk LRU: the retained file stays
        r = c.post("/v1/completions", json={**body, "prompt": f"Churn number {i}: " + SYSTEM[::-1][:200]})
        assert r.status_code == 200
    assert [e.path for e in list_dir(d)[0] if e.expires_at] == [entry.path]
    r = c.post("/v1/completions", json={**body, "prompt_cache_retention": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"


def test_a_content_over_a_lasting_pin_lives_its_ttl_and_leaves_the_pin(make_client):
    c = make_client()
    pin = c.post("/v1/cache/pin", json={"messages": AS_MESSAGES}).json()
    made = create(c, messages=AS_MESSAGES, contents=None, system_instruction=None)
    assert made["usage_metadata"]["total_token_count"] == pin["tokens"]
    assert c.get(f"/v1/cached_contents/{made['name']}").status_code == 200
    [entry] = [e for e in c.get("/v1/cache").json()["entries"] if e["pinned"]]
    assert entry["names"] == [made["name"]] and entry["expires_at"] is None  # lasting: it does not expire
    assert c.delete(f"/v1/cached_contents/{made['name']}").status_code == 200
    assert c.get("/v1/cache").json()["pinned_bytes"] == pin["pinned_bytes"]  # the lasting pin stays
