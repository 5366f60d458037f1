"""Write docs/cli.md, the command-line reference, from the argparse parsers of `jaxsmol` and `aitest`.

    python tools/make_cli_docs.py            # rewrite docs/cli.md
    python tools/make_cli_docs.py --check    # exit 1 if docs/cli.md differs from the parsers

tests/test_docs.py regenerates the page in memory and compares it with the file, so a new option or a
changed default shows up as a failing test until this script is run again. The text comes from the
parsers (help strings, metavars, defaults, choices); an option without a help string takes its line
from FALLBACK_HELP below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "cli.md"

# (command, option) -> the description of an option whose parser gives none
FALLBACK_HELP = {
    ("*", "--max-tokens"): "tokens to generate at most",
    ("*", "--top-k"): "sample from the K most likely tokens only (0 = off)",
    ("*", "--top-p"): "sample from the smallest set of tokens whose probability reaches P (1 = off)",
    ("*", "--seed"): "the sampler's seed (choice i of a request samples with seed + i)",
    ("*", "--dtype"): "the weights' dtype (bfloat16 halves their memory; activations and the cache stay float32 "
                      "on the CPU kernels)",
    ("*", "--model"): "a Hugging Face SmolLM checkpoint directory (default: the bundled SmolLM2-135M-Instruct)",
    ("*", "--chat"): "apply the model's chat template to the text",
    ("*", "--json"): "print one JSON object",
    ("cacheprobe", "--cache-mode"): "the prefix cache: radix (many prefixes, longest match), single (one snapshot "
                                    "of the first prompt_n - 1 tokens), off",
    ("aitest", "--cache-mode"): "the prefix cache: single (one snapshot of the first prompt_n - 1 tokens), radix, off",
    ("cacheprobe", "--max-tokens"): "ignored: --predict sets the tokens to generate",
    ("aitest", "--max-tokens"): "ignored: --predict sets the tokens to generate",
    ("serve", "--host"): "the address to listen on (loopback by default; other addresses want API keys)",
    ("serve", "--port"): "the TCP port",
    ("serve", "--cache-mode"): "radix (many prefixes, longest match) or single (one snapshot of the first "
                               "prompt_n - 1 tokens)",
    ("tokenize", "text"): "the text to tokenize",
    ("import-gguf", "file"): "the GGUF file (Llama architecture)",
    ("import-gguf", "outdir"): "the directory to write (config.json, model.safetensors, tokenizer files)",
}

ENVIRONMENT = """\
## Environment

| variable | what |
|---|---|
| `JAXSMOL_HOME` | the data directory (default `~/.cache/jaxsmol`): `models/` (the imported default model), \
`xla-cache/programs/` (compiled programs, loaded without tracing), `kernels/` (the C++ kernels compiled on \
first use where the install holds no prebuilt library this CPU runs) |
| `JAXSMOL_KERNELS_DIR` | where the C++ kernels compiled on first use are kept instead of `$JAXSMOL_HOME/kernels` \
(several homes sharing one build) |
| `JAXSMOL_COMPILE_CACHE` | where compiled programs are kept (default `$JAXSMOL_HOME/xla-cache`); `off` keeps none |
| `JAXSMOL_KERNELS` | the C++ CPU kernels: `auto` (default: used where they build), `on` (required: one \
error line where they cannot be built), `off` (XLA's own ops only). The former name `JAXSMOL_CPU_KERNELS` \
is still read |
| `CXX` | the C++ compiler that builds the kernels (default `c++`; a wheel's prebuilt kernels need none) |
| `JAXSMOL_DEBUG` | `1`: an internal error prints its traceback instead of one line |

## Exit status

0 on success; 2 for bad input (one line on stderr starting with `error:`, no usage dump); 1 for an
internal error (one line, or the traceback with `JAXSMOL_DEBUG=1`); 130 when interrupted.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _metavar(a: argparse.Action) -> str:
    if a.nargs == 0:
        return ""
    if a.choices is not None and a.metavar is None:
        name = "{" + ",".join(map(str, a.choices)) + "}"
    else:
        name = a.metavar or (a.dest if not a.option_strings else a.dest.upper())
    if a.nargs == "+":
        return f"{name} [{name} ...]"
    if a.nargs == "*":
        return f"[{name} ...]"
    if a.nargs == "?" and not a.option_strings:
        return f"[{name}]"
    return name


def _default(a: argparse.Action) -> str:
    if a.nargs == 0 or a.default in (None, argparse.SUPPRESS) or a.default == []:
        return ""
    return f"`{a.default}`"


def _help(command: str, a: argparse.Action) -> str:
    name = a.option_strings[-1] if a.option_strings else a.dest
    text = a.help or FALLBACK_HELP.get((command, name)) or FALLBACK_HELP.get(("*", name), "")
    if a.choices is not None and a.metavar is not None:
        text += f" (one of {', '.join(map(str, a.choices))})"
    return _cell(text)


def _options(command: str, parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | argument | default | description |", "|---|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{_metavar(a) or a.dest}` (positional)"
        arg = _metavar(a) if a.option_strings else ""
        rows.append(f"| {names} | {_cell(arg) and f'`{_cell(arg)}`'} | {_default(a)} | {_help(command, a)} |")
    return rows


def _synopsis(prog: str, parser: argparse.ArgumentParser) -> str:
    positionals = " ".join(_metavar(a) for a in parser._actions if not a.option_strings)
    return " ".join(x for x in (prog, positionals, "[options]") if x)


def _section(title: str, prog: str, parser: argparse.ArgumentParser, summary: str | None) -> list[str]:
    out = [f"## {title}", ""]
    for text in (summary, parser.description):
        if text:
            out += [_cell(text), ""]
    out += ["```", _synopsis(prog, parser), "```", "", *_options(title.strip("`").split()[-1], parser), ""]
    return out


def render() -> str:
    """docs/cli.md's text, from the parsers."""
    from jaxsmol.cli.aitest import build_parser as aitest_parser
    from jaxsmol.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    lines = ["# Command-line reference", "",
             "<!-- Generated by tools/make_cli_docs.py from the argparse parsers; do not edit by hand. -->", "",
             f"`jaxsmol` ({_cell(parser.description)}) has the commands "
             + ", ".join(f"[`{name}`](#jaxsmol-{name})" for name in sub.choices)
             + "; `aitest` is the course exercise's client ([below](#aitest)). "
             "`jaxsmol COMMAND --help` prints the same options.", ""]
    for name, p in sub.choices.items():
        lines += _section(f"jaxsmol {name}", f"jaxsmol {name}", p, helps.get(name))
    lines += _section("aitest", "aitest", aitest_parser(), None)
    return "\n".join(lines) + ENVIRONMENT


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is not what the parsers give")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("docs/cli.md is up to date" if same else "docs/cli.md differs: run python tools/make_cli_docs.py")
        return 0 if same else 1
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
