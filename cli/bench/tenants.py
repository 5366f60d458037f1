"""The cluster section's workload (cli/bench/cluster.py): tenants, each with its own few-shot prefix,
sending requests that share it, and the clients that send them.

Every tenant's prefix is a few-shot text of its own from its first characters on (so a router's tree
of past prompts tells the tenants apart), sized to `prefix_tokens` with the model's tokenizer. The
completions workload is `per_tenant` requests a tenant, the prefix and a unique question of
~`suffix_tokens` tokens each, in one shuffled order; the chat workload is `conversations` a tenant of
`turns` turns each (the prefix as the system message, each turn one question more, the answers sent
back as the assistant's), the conversations in a shuffled order. `clients` concurrent clients take
the next request (or conversation) as they finish one; every answer streams, so each request's time
to its first token is measured. With `first_together`, every tenant's first request (or conversation)
is sent at once before the others: a router then sees them all while they are in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import httpx

NAMES = ("Harbor freight desk", "Orchard clinic helpline", "Quartz legal intake", "Meadow school office",
         "Copper bank support", "Tundra travel agency", "Violet garden shop", "Ember game studio")
WORDS = ("river stone lamp paper window garden market letter engine winter summer silver orange camera "
         "pencil ticket harbor valley forest castle bridge rocket island planet doctor teacher farmer pilot "
         "invoice parcel refund delivery schedule payment account balance warranty contract meeting").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def few_shot_prefix(rng: random.Random, tenant: int, tokens: int, count) -> str:
    """Tenant `tenant`'s few-shot text of at least `tokens` tokens (count(text) -> tokens)."""
    name = NAMES[tenant % len(NAMES)] + ("" if tenant < len(NAMES) else f" {tenant}")
    text = f"{name}. Answer the customer's question in one short sentence, as in these examples.\n"
    i = 0
    while count(text) < tokens:
        i += 1
        text += f"Example {i}. Q: {_words(rng, rng.randint(6, 10))}? A: {_words(rng, rng.randint(6, 12))}.\n"
    return text


def question(rng: random.Random, tokens: int) -> str:
    """A question of about `tokens` tokens (one a word here, give or take)."""
    return f"Q: {_words(rng, max(1, tokens - 4))}? A:"


@dataclasses.dataclass(frozen=True)
class Workload:
    prefixes: list[str]  # per tenant
    completions: list[tuple[int, str]]  # (tenant, prompt), in sending order
    chats: list[tuple[int, list[str]]]  # (tenant, the user turns of one conversation), in sending order


def build_workload(seed: int, tenants: int, per_tenant: int, prefix_tokens: int, suffix_tokens: int,
                   turns: int, count) -> Workload:
    rng = random.Random(seed)
    prefixes = [few_shot_prefix(rng, t, prefix_tokens, count) for t in range(tenants)]
    completions = [(t, prefixes[t] + question(rng, suffix_tokens)) for t in range(tenants) for _ in range(per_tenant)]
    rng.shuffle(completions)
    chats = [(t, [question(rng, suffix_tokens) for _ in range(turns)])
             for t in range(tenants) for _ in range(max(1, per_tenant // turns))]
    rng.shuffle(chats)
    return Workload(prefixes, completions, chats)


async def _stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> tuple[float, str]:
    """(seconds to the first token, the answer's text) of one streamed request."""
    t0, first, parts = time.perf_counter(), None, []
    async with client.stream("POST", url + path, json={**body, "stream": True}, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = choices[0].get("text") if "text" in choices[0] else (choices[0].get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                parts.append(piece)
    return (first or time.perf_counter()) - t0, "".join(parts)


def _sampling(tokens: int) -> dict:
    return {"model": "m", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


def _firsts_then_rest(items: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """(every tenant's first item, the others), each in sending order."""
    seen: set[int] = set()
    firsts = [x for x in items if x[0] not in seen and not seen.add(x[0])]
    chosen = {id(x) for x in firsts}
    return firsts, [x for x in items if id(x) not in chosen]


async def _completions(url: str, todo, clients: int, tokens: int, work: Workload) -> list[float]:
    todo, ttfts = iter(todo), []

    async def client_loop(client):
        for _, prompt in todo:
            ttft, _ = await _stream(client, url, "/v1/completions", {"prompt": prompt, **_sampling(tokens)})
            ttfts.append(ttft)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 2)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return ttfts


async def _chats(url: str, todo, clients: int, tokens: int, work: Workload) -> list[float]:
    todo, ttfts = iter(todo), []

    async def client_loop(client):
        for tenant, questions in todo:
            messages = [{"role": "system", "content": work.prefixes[tenant]}]
            for q in questions:
                messages.append({"role": "user", "content": q})
                ttft, answer = await _stream(client, url, "/v1/chat/completions",
                                             {"messages": messages, **_sampling(tokens)})
                messages.append({"role": "assistant", "content": answer})
                ttfts.append(ttft)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 2)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return ttfts


def send(url: str, work: Workload, variant: str, clients: int, tokens: int,
         first_together: bool = False) -> tuple[list[float], float]:
    """Send the variant's requests ("completions" or "chat") through `url`: (TTFTs in s, wall s)."""
    run, items = (_completions, work.completions) if variant == "completions" else (_chats, work.chats)
    batches = [(items, clients)]
    if first_together:
        firsts, rest = _firsts_then_rest(items)
        batches = [(firsts, len(firsts)), (rest, clients)]
    t0, ttfts = time.perf_counter(), []
    for todo, n in batches:
        ttfts += asyncio.run(run(url, todo, n, tokens, work))
    return ttfts, time.perf_counter() - t0
