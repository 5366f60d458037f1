"""docs/serving.md's example outputs are what `jaxsmol serve` answers on the bundled model.

One daemon (`jaxsmol serve` on the bundled model, its programs compiled on first use rather than
ahead: that changes when they compile, not what is answered) stands for localhost:8000. Every block
of the page that talks to it runs, in page order, as a reader following the page would run them
(the cache fills as it goes); a ```json block right after one, or a ```text block of server-sent
events, is what that block printed. The page's notation:

* `...` closing an object: more members follow; closing a list: more items; a line `...` alone in a
  stream of events: more events (its `event:` lines are not compared: each names its data's `type`);
* `<words>`: a value that differs from run to run (ids, times): bare, a number; inside a string, any
  text (`<N hex digits>`: that many);
* a number with a fraction agrees to the digits shown (within one unit of the last one);
* everything else is equal: the texts of greedy answers, token counts, max_model_len, sizes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from doc_blocks import DAEMON_ADDRESS, ROOT, RUNNABLE_LANGS, Block, bash_on, fenced_blocks, run_env

PAGE = ROOT / "docs" / "serving.md"
MORE, VARIES = "\0more", "\0varies"  # what `...` and a bare `<words>` stand for once parsed
PLACEHOLDER = re.compile(r"<([a-z0-9 ]+)>")


class Shown(float):
    """A number with a fraction as the page shows it: its value, and the digits after the point."""

    def __new__(cls, text: str):
        value = super().__new__(cls, text)
        value.digits = len(text.split(".")[1].split("e")[0].split("E")[0]) if "." in text else 0
        return value


# ---- the page's notation -------------------------------------------------------------------------------------
def to_json(text: str) -> str:
    """The page's JSON with `...` and bare `<words>` replaced by the MORE and VARIES markers."""
    out, stack, i = [], [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            end = i + 1
            while text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i:end + 1])
            i = end + 1
            continue
        if text.startswith("...", i):
            out.append(json.dumps(MORE) + (": true" if stack and stack[-1] == "{" else ""))
            i += 3
            continue
        if c == "<" and (m := PLACEHOLDER.match(text, i)):
            out.append(json.dumps(VARIES))
            i = m.end()
            continue
        if c in "{[":
            stack.append(c)
        elif c in "}]":
            stack.pop()
        out.append(c)
        i += 1
    return "".join(out)


def values(text: str, parse_float=float) -> list:
    """The JSON values written one after another in `text`."""
    decoder, out, i = json.JSONDecoder(parse_float=parse_float), [], 0
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        value, i = decoder.raw_decode(text, i)
        out.append(value)
    return out


def patterns(block: Block) -> list:
    """An output block's expected values; for a stream of events, its `data:` lines (MORE for a line `...`;
    an `event:` line, naming the next one's type, is what the data's own `type` says)."""
    if block.lang == "json":
        return values(to_json(block.code), Shown)
    lines = [line.strip() for line in block.code.splitlines() if line.strip() and not line.startswith("event: ")]
    return [MORE if line == "..." else line if line == "data: [DONE]" else values(to_json(line[6:]), Shown)[0]
            for line in lines]


def printed(block: Block, stdout: str) -> list:
    """What a command block printed, as its output block shows it."""
    if block.lang == "json":
        return values(stdout)
    return [line if line == "data: [DONE]" else json.loads(line[6:])
            for line in stdout.splitlines() if line.startswith("data: ")]


# ---- matching ----------------------------------------------------------------------------------------------
def check(expected, actual, where: str = "") -> None:
    """AssertionError naming the first place where `actual` is not what the page shows."""
    if expected == VARIES:
        assert isinstance(actual, (int, float)) and not isinstance(actual, bool), f"{where}: {actual!r} is no number"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {actual!r} is not an object"
        shown = {k: v for k, v in expected.items() if k != MORE}
        missing, extra = set(shown) - set(actual), set(actual) - set(shown)
        assert not missing and (MORE in expected or not extra), f"{where}: lacks {missing}, has more: {extra}"
        for k, v in shown.items():
            check(v, actual[k], f"{where}.{k}")
    elif isinstance(expected, list):
        check_sequence(expected, actual, where)
    elif isinstance(expected, Shown):
        assert isinstance(actual, (int, float)) and abs(actual - expected) <= 10.0 ** -expected.digits + 1e-9, \
            f"{where}: {actual!r}, the page shows {expected}"
    elif isinstance(expected, str) and PLACEHOLDER.search(expected):
        assert isinstance(actual, str) and re.fullmatch(_regex(expected), actual), f"{where}: {actual!r}"
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r}, the page: {expected!r}"


def _regex(text: str) -> str:
    parts = PLACEHOLDER.split(text)  # literal, words, literal, ...
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
        else:
            n = re.fullmatch(r"(\d+) hex digits", part)
            out.append(f"[0-9a-f]{{{n[1]}}}" if n else ".+?")
    return "".join(out)


def check_sequence(expected: list, actual: list, where: str) -> None:
    """A list: item by item, a final `...` allowing more; a stream: a `...` line anywhere stands for
    any number of events."""
    assert isinstance(actual, list), f"{where}: {actual!r} is not a list"
    if MORE not in expected:
        assert len(actual) == len(expected), f"{where}: {len(actual)} items, the page shows {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            check(e, a, f"{where}[{i}]")
        return
    gap = expected.index(MORE)
    head, tail = expected[:gap], expected[gap + 1:]
    assert len(actual) >= len(head) + len(tail) - tail.count(MORE), f"{where}: fewer items than the page shows"
    check_sequence(head, actual[:len(head)], where)
    rest = actual[len(head):]
    if not tail:
        return
    # what follows the gap: where it first fits (it has gaps too), else at the end (its length fixed)
    starts = list(range(len(rest) + 1)) if MORE in tail else [len(rest) - len(tail)]
    for start in starts[:-1]:
        if _fits(tail, rest[start:]):
            return
    check_sequence(tail, rest[starts[-1]:], f"{where}[{len(head) + starts[-1]}:]")


def _fits(expected: list, actual: list) -> bool:
    try:
        check_sequence(expected, actual, "")
    except AssertionError:
        return False
    return True


# ---- the page, run -------------------------------------------------------------------------------------------
def session(blocks: list[Block]) -> list[tuple[Block, Block | None]]:
    """The page's blocks that talk to the daemon, in order, each with the output block right after it."""
    out = []
    for i, b in enumerate(blocks):
        runs = b.lang in RUNNABLE_LANGS and b.marker in (None, ("error", None)) and DAEMON_ADDRESS.search(b.code)
        if runs:
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            out.append((b, after if after is not None and after.lang in ("json", "text") else None))
    return out


def run_block(block: Block, address: str, cwd) -> str:
    code = DAEMON_ADDRESS.sub(address, block.code)
    cmd = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-e", "-o", "pipefail", "-c",
                                                                     bash_on(block.code, None, address)]
    r = subprocess.run(cmd, cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block.id} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_the_notation():
    shown = patterns(Block(PAGE, 0, "json", '{"id": "cmpl-<4 hex digits>", "t": <time>, "x": [1, ...], '
                                            '"lp": -1.25, ...}\n{"a": null}', None))
    check(shown, [{"id": "cmpl-0af3", "t": 17.5, "x": [1, 2], "lp": -1.2549, "more": 1}, {"a": None}])
    for bad in ([{"id": "cmpl-0af", "t": 1, "x": [1], "lp": -1.25}, {"a": None}],
                [{"id": "cmpl-0af3", "t": "1", "x": [1], "lp": -1.25}, {"a": None}],
                [{"id": "cmpl-0af3", "t": 1, "x": [2], "lp": -1.25}, {"a": None}],
                [{"id": "cmpl-0af3", "t": 1, "x": [1], "lp": -1.27}, {"a": None}],
                [{"id": "cmpl-0af3", "t": 1, "x": [1], "lp": -1.25}, {"a": None, "b": 1}]):
        with pytest.raises(AssertionError):
            check(shown, bad)
    stream = patterns(Block(PAGE, 0, "text", 'data: {"n": 1}\n...\ndata: {"n": 9}\ndata: [DONE]', None))
    check(stream, [{"n": 1}, {"n": 5}, {"n": 6}, {"n": 9}, "data: [DONE]"])
    with pytest.raises(AssertionError):
        check(stream, [{"n": 1}, {"n": 8}, "data: [DONE]"])


@pytest.mark.real  # the bundled model
def test_the_serving_pages_outputs_are_what_the_daemon_answers(model_dir, tmp_path):
    from daemon import Server

    steps = session(fenced_blocks(PAGE))
    assert sum(out is not None for _, out in steps) >= 8, "the page's examples were not found"
    server = Server(ctx=None).wait_ready()  # the bundled model, its own context
    try:
        for block, out in steps:
            stdout = run_block(block, server.url.removeprefix("http://"), tmp_path)
            if out is not None:
                check(patterns(out), printed(out, stdout), out.id)
    finally:
        server.stop()
