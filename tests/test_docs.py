"""The documentation a user reads: README.md, CHANGELOG.md and docs/*.md.

* docs/cli.md is what tools/make_cli_docs.py writes from the parsers (regenerate it after a CLI change).
* Every `jaxsmol serve` option and every metric the daemon exports is on docs/serving.md.
* Every relative link (and its #anchor) resolves; the README stays short and links every page.
* No page narrates the project's development (rounds of work, "this session", "before the fix").
* Every ```bash / ```sh and ```python block runs. The commands run on `tiny_model_dir` (a two-layer
  checkpoint with the real tokenizer): `--model DIR` is added where a command takes it and the text
  says the default model, and `Engine.load()` loads that directory. Blocks that talk to
  `localhost:8000` run against a daemon this module starts. A block may be skipped only with a
  `<!-- docs-test: skip (REASON) -->` line right before it, whose reason names the test that covers it;
  `<!-- docs-test: error -->` marks a block whose request is answered with an HTTP error on purpose.
* docs/serving.md's example outputs are checked against the bundled model in tests/test_docs_serving.py.
* docs/python.md's `>>>` examples pass as doctests.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import DAEMON_ADDRESS, ROOT, RUNNABLE_LANGS, bash_on, fenced_blocks, python_prelude, run_env

PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]
# <!-- docs-test: error --> before a block: its request is answered with an HTTP error on purpose
RUN = [b for b in BLOCKS if b.lang in RUNNABLE_LANGS and b.marker in (None, ("error", None)) and ">>>" not in b.code]
SKIPPED = [b for b in BLOCKS if b.marker is not None and b.marker[0] != "error"]


# ---- generated and complete ------------------------------------------------------------------------------
def test_the_cli_reference_is_generated_from_the_parsers():
    from make_cli_docs import render

    assert (ROOT / "docs" / "cli.md").read_text() == render(), "docs/cli.md is stale: python tools/make_cli_docs.py"


def test_every_serve_option_is_on_the_serving_page():
    from jaxsmol.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    options = {o for a in sub.choices["serve"]._actions for o in a.option_strings if o not in ("-h", "--help")}
    table = (ROOT / "docs" / "serving.md").read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    missing = {o for o in options if not re.search(rf"`{re.escape(o)}[` ]", table)}
    assert not missing, f"docs/serving.md's options table lacks {sorted(missing)}"


def test_every_metric_is_on_the_serving_page():
    from jaxsmol.cli.server import metrics as M

    names = {"jaxsmol_requests_total", "jaxsmol_prompt_tokens_total", "jaxsmol_completion_tokens_total",
             "jaxsmol_time_to_first_token_seconds", "jaxsmol_cancelled_total", "jaxsmol_rejected_total",
             "jaxsmol_queue_depth", "jaxsmol_pool_bytes", "jaxsmol_cache_bypasses_total", "jaxsmol_cache_bytes",
             "jaxsmol_cache_disk_bytes", "jaxsmol_cache_pinned_bytes", "jaxsmol_read_timeouts_total",
             "jaxsmol_cache_disk_refused_total"}
    names |= {f"jaxsmol_cache_{k}_total" for k, _ in M.CACHE_COUNTERS}
    names |= ({f"jaxsmol_batch_{k}" for k, _ in M.BATCH_GAUGES}
              | {f"jaxsmol_batch_{k}_total" for k, _ in M.BATCH_COUNTERS})
    names |= {f"jaxsmol_{k}" for k, _ in M.MEMORY_GAUGES} | {name for name, _, _ in M.VLLM_ALIASES}
    page = (ROOT / "docs" / "serving.md").read_text()
    missing = {n for n in names if f"`{n}" not in page}
    assert not missing, f"docs/serving.md does not name {sorted(missing)}"


# ---- links, length, no diary -------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading in {dest.name})")
    assert not bad, "\n".join(bad)


def test_the_readme_is_short_and_links_every_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for page in ("docs/design.md", "docs/serving.md", "docs/cli.md", "docs/python.md", "docs/performance.md",
                 "CHANGELOG.md"):
        assert f"]({page}" in text, page
    assert "`docs/`" in text.split("## Layout", 1)[1]  # the layout names the docs folder


NARRATION = re.compile(r"\b(?:(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) "
                       r"(?:session|stop)|sessions?\b|before the fix|after the fix|tried and not|was tried|we tried|"
                       r"round of work|rounds of work)", re.I)


def test_no_page_narrates_the_projects_development():
    found = [f"{page.name}:{n}: {line.strip()}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert not found, "\n".join(found)


def test_the_version_is_in_the_changelog():
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()


def test_a_skipped_block_names_the_test_that_covers_it():
    assert SKIPPED, "no skipped block: this test checks nothing"
    for b in SKIPPED:
        kind, reason = b.marker
        assert kind == "skip" and reason, f"{b.id}: <!-- docs-test: skip (REASON) --> with a reason"
        covering = re.findall(r"(tests/test_\w+\.py|\.ci/run)", reason)
        assert covering and all((ROOT / c).exists() for c in covering), f"{b.id}: the reason names no existing test"


# ---- the blocks run ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs_daemon(tiny_model_dir):
    """`jaxsmol serve` on the two-layer checkpoint: the address the pages' localhost:8000 stands for."""
    from daemon import Server

    server = Server("--model", str(tiny_model_dir)).wait_ready()
    yield server.url.removeprefix("http://")
    server.stop()


@pytest.mark.real  # the real tokenizer (from the bundled model), tiny random weights
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_the_block_runs(block, tiny_model_dir, tmp_path, request):
    address = request.getfixturevalue("docs_daemon") if DAEMON_ADDRESS.search(block.code) else None
    if block.lang == "python":
        code = python_prelude(tiny_model_dir) + (DAEMON_ADDRESS.sub(address, block.code) if address else block.code)
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", bash_on(block.code, tiny_model_dir, address)]
    if block.marker is None:
        (tmp_path / ".curlrc").write_text("fail\n")  # curl: an HTTP error status fails the block
    r = subprocess.run(cmd, cwd=tmp_path, env={**run_env(), "CURL_HOME": str(tmp_path)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{block.id} failed ({r.returncode}):\n{cmd[-1]}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.real
def test_the_python_page_passes_its_doctests(tiny_model_dir):
    script = python_prelude(tiny_model_dir) + (
        "import doctest, sys\n"
        f"failed, attempted = doctest.testfile({str(ROOT / 'docs' / 'python.md')!r}, module_relative=False,\n"
        "                                     optionflags=doctest.ELLIPSIS)\n"
        "print(f'{attempted} examples, {failed} failed')\n"
        "sys.exit(1 if failed or not attempted else 0)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def test_every_commands_help_prints():
    """`jaxsmol COMMAND --help` formats every option's help (a bare % in one made argparse raise)."""
    from jaxsmol.cli.aitest import build_parser as aitest_parser
    from jaxsmol.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    for name, parser in sub.choices.items():
        assert parser.format_help().startswith("usage:"), name
    assert aitest_parser().format_help().startswith("usage:")
