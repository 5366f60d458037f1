"""`--only speculate`: one stream's decode tokens/s with speculation (`--speculate ngram`) against plain
decoding (`none`), greedy, on prompts that repeat text (a one-shot "Original:/Copy:" passage, a function
restated with one name changed, a second chat turn that repeats its answer), a JSON schema with long
keys (jump-forward) and open-ended text; asked fresh (nothing stored: drafts from the request's own
tokens and its schema) and asked again (the prefix cache holds the earlier answer: drafts from it too,
the default `--speculate auto`); they alternate, `--rounds` times, medians reported, and the outputs
must be equal (a row says so). With --draft-model, a fourth way: that model's drafts (`--speculate draft`),
fresh. Then the 8 requests of `BATCH` (the five, and three more open ones) as one
continuous batch of 8 rows, plain against `auto` (nothing stored), alternated: tokens/s over the batch's
wall time. With --peer-url, the same prompt texts (and schema) to a
llama.cpp server's /completion, greedy, the same number of tokens: its own decode tokens/s
(`timings.predicted_per_second`; each prompt is sent every round, so a server that keeps drafts across
requests, as `--spec-type ngram-mod` does, meets it again as jaxsmol's "again" does). Start it once
plain and once with `--spec-type ngram-mod` to read its gain beside jaxsmol's.
"""

from __future__ import annotations

import json

import httpx

from jaxsmol.cli.bench.measure import log, median
from jaxsmol.cli.tables import format_table

PASSAGE = ("The river runs north through the valley, past the old mill and the stone bridge, until it reaches "
           "the lake where the fishermen keep their boats in summer and the children skate in winter.")
# A function with nothing to simplify, so SmolLM2-135M restates it whole (a summing loop it rewrites as
# `return sum(values)`, leaving nothing to copy).
CODE = ("def tidy(name):\n    name = name.strip()\n    name = name.replace('_', ' ')\n    if not name:\n"
        "        raise ValueError('empty name')\n    return name.title()\n")
MOON = ("1. The Moon orbits the Earth about every 27 days.\n2. The Moon has no atmosphere to speak of.\n"
        "3. The Moon's gravity causes the tides on Earth.")
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["customer_full_name", "shipping_street_address", "preferred_delivery_window", "gift_wrapping"],
          "properties": {"customer_full_name": {"type": "string"}, "shipping_street_address": {"type": "string"},
                         "preferred_delivery_window": {"type": "string"}, "gift_wrapping": {"type": "boolean"}}}
MORE_OPEN = ("Write a poem about the sea.", "Explain photosynthesis to a child.", "Describe a busy market at dawn.")
# name -> (chat messages, JSON schema or None)
PROMPTS = {
    "copy": ([("user", "Copy the text exactly.\nOriginal: The cat sat on the mat.\nCopy: The cat sat on the "
                       f"mat.\nOriginal: {PASSAGE}\nCopy:")], None),
    "rename": ([("user", "Rewrite this function with the name clean_name instead of tidy, nothing else changed:\n"
                         + CODE)], None),
    "turn 2": ([("user", "List three facts about the Moon."), ("assistant", MOON),
                ("user", "Repeat your list exactly, then add a fourth fact.")], None),
    "json": ([("user", "An order for Ada Lovelace, 12 Analytical Lane, London, mornings, gift wrapped. As JSON.")],
             SCHEMA),
    "open": ([("user", "Write a short story about a dragon who learns to bake bread.")], None),
}


def _structured(schema) -> str | None:
    from jaxsmol.runtime.structured import canonical_spec

    return None if schema is None else canonical_spec({"type": "json_schema", "json_schema": {"schema": schema}})


def _ours(engine, ids, tokens: int, schema, mode: str, cache=None, draft=None) -> dict:
    """One request, plain (mode "none") or speculating; through `cache` (an answer stored there before
    is drafted from), else with no prefix cache; `draft` a DraftModel for mode "draft"."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import _run
    from jaxsmol.cache.scheduler.requests import Collector, Request
    from jaxsmol.cache.scheduler.scheduler import Scheduler
    from jaxsmol.runtime.sampling import SamplingParams

    sched = Scheduler(cache or PrefixCache(engine, mode="off"), draft if mode == "draft" else None, max_batch=1,
                      speculate=mode)
    sp = SamplingParams(max_tokens=tokens, structured=_structured(schema))
    r = _run(sched, [Request(list(ids), [sp], Collector())])[0][0]
    return {"tok_s": r.timings.decode_tok_s, "ids": r.output_ids, "drafted": sched.stats.drafted,
            "accepted": sched.stats.accepted, "steps": sched.stats.steps}


def _batch(engine, requests: list, tokens: int, mode: str) -> dict:
    """requests [(ids, schema)] as one continuous batch (a row each, no prefix cache): tokens/s over its
    wall time, each one's output ids, and the drafts verified."""
    import time

    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import _run
    from jaxsmol.cache.scheduler.requests import Collector, Request
    from jaxsmol.cache.scheduler.scheduler import Scheduler
    from jaxsmol.runtime.sampling import SamplingParams

    sched = Scheduler(PrefixCache(engine, mode="off"), max_batch=len(requests), speculate=mode)
    reqs = [Request(list(ids), [SamplingParams(max_tokens=tokens, structured=_structured(schema))], Collector())
            for ids, schema in requests]
    t0 = time.perf_counter()
    results = _run(sched, reqs)
    wall = time.perf_counter() - t0
    ids = [r[0].output_ids for r in results]
    return {"tok_s": sum(map(len, ids)) / wall, "ids": ids, "drafted": sched.stats.drafted,
            "accepted": sched.stats.accepted}


def _peer(url: str, text: str, tokens: int, schema) -> float:
    body = {"prompt": text, "n_predict": tokens, "temperature": 0, "cache_prompt": False}
    if schema is not None:
        body["json_schema"] = schema
    r = httpx.post(url.rstrip("/") + "/completion", json=body, timeout=600)
    r.raise_for_status()
    return float(r.json()["timings"]["predicted_per_second"])


def section_speculate(engine, plan, peer_url: str | None, draft_engine=None) -> dict:
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.draft_model import DraftModel

    tokens, rounds, tok = plan["spec_tokens"], plan["spec_rounds"], engine.tokenizer
    draft = DraftModel(draft_engine, PrefixCache(engine, mode="off")) if draft_engine is not None else None
    rows = []
    for name, (messages, schema) in PROMPTS.items():
        text = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages])
        ids, cache = tok.encode(text), PrefixCache(engine)
        ways = {"none": ("none", None), "fresh": ("auto", None), "again": ("auto", cache)}
        if draft is not None:
            ways["draft"] = ("draft", None)
        runs = {way: [] for way in ways} | {"peer": []}
        for mode, through in ways.values():  # compile and settle (and store the answer "again" drafts from)
            _ours(engine, ids, tokens, schema, mode, through, draft)
        for _ in range(rounds):
            for way, (mode, through) in ways.items():
                runs[way].append(_ours(engine, ids, tokens, schema, mode, through, draft))
            if peer_url:
                runs["peer"].append(_peer(peer_url, text, tokens, schema))
        row = {"prompt": name, "tokens": len(runs["none"][-1]["ids"]),
               "same": all(r["ids"] == p["ids"] for way in ways for r, p in zip(runs[way], runs["none"])),
               "peer_tok_s": median(runs["peer"]) if runs["peer"] else None}
        for way, results in runs.items():
            if way != "peer":
                row[f"{way}_tok_s"] = median([r["tok_s"] for r in results])
                row[way] = {k: results[-1][k] for k in ("drafted", "accepted", "steps")}
        rows.append(row)
        log(f"speculate {name}: plain {row['none_tok_s']:.1f} tok/s, fresh {row['fresh_tok_s']:.1f}, "
            f"again {row['again_tok_s']:.1f}" + (f", draft {row['draft_tok_s']:.1f}" if draft else "")
            + f", same {row['same']}")
    return {"tokens": tokens, "rounds": rounds, "peer_url": peer_url, "rows": rows, "draft_model": draft is not None,
            "schema": json.dumps(SCHEMA), "batch": _batch_row(engine, tokens, rounds)}


def _batch_row(engine, tokens: int, rounds: int) -> dict:
    tok = engine.tokenizer
    chats = [(messages, schema) for messages, schema in PROMPTS.values()] + [([("user", m)], None) for m in MORE_OPEN]
    requests = [(tok.encode(tok.apply_chat_template([{"role": r, "content": c} for r, c in messages])), schema)
                for messages, schema in chats]
    runs = {"none": [], "auto": []}
    for mode in runs:  # compile and settle
        _batch(engine, requests, tokens, mode)
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(_batch(engine, requests, tokens, mode))
    row = {"clients": len(requests), "plain_tok_s": median([r["tok_s"] for r in runs["none"]]),
           "spec_tok_s": median([r["tok_s"] for r in runs["auto"]]),
           "same": all(a["ids"] == b["ids"] for a, b in zip(runs["auto"], runs["none"])),
           "drafted": runs["auto"][-1]["drafted"], "accepted": runs["auto"][-1]["accepted"]}
    log(f"speculate batch of {row['clients']}: plain {row['plain_tok_s']:.1f} tok/s, "
        f"speculating {row['spec_tok_s']:.1f}, same {row['same']}")
    return row


def format_speculate(t: dict) -> list[str]:
    peer, ways = t["peer_url"] is not None, ("fresh", "again") + (("draft",) if t.get("draft_model") else ())
    head = ["prompt", "plain tok/s"] + [h for way in ways for h in (f"{way} tok/s", "x plain", "accepted/drafted")]
    head.append("same")
    rows = []
    for r in t["rows"]:
        row = [r["prompt"], f"{r['none_tok_s']:.1f}"]
        for way in ways:
            row += [f"{r[f'{way}_tok_s']:.1f}", f"{r[f'{way}_tok_s'] / r['none_tok_s']:.2f}x",
                    f"{r[way]['accepted']}/{r[way]['drafted']}"]
        row.append("yes" if r["same"] else "NO")
        if peer:
            row += [f"{r['peer_tok_s']:.1f}", f"{r['again_tok_s'] / r['peer_tok_s']:.2f}x"]
        rows.append(row)
    head += ["peer tok/s", "again / peer"] if peer else []
    title = (f"speculation, one stream, greedy, {t['tokens']} tokens, medians of {t['rounds']} alternated rounds"
             + (f"; peer {t['peer_url']}" if peer else ""))
    b = t["batch"]
    batch = format_table(["rows", "plain tok/s", "speculate tok/s", "x plain", "accepted/drafted", "same"],
                         [[b["clients"], f"{b['plain_tok_s']:.1f}", f"{b['spec_tok_s']:.1f}",
                           f"{b['spec_tok_s'] / b['plain_tok_s']:.2f}x", f"{b['accepted']}/{b['drafted']}",
                           "yes" if b["same"] else "NO"]],
                         title=f"the same prompts and three more open ones as one batch, {t['tokens']} tokens each")
    return [format_table(head, rows, title=title), batch]
