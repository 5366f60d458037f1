"""Shared CLI plumbing: model options, the persistent compilation cache, one-line errors."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from jaxsmol.system import progress


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "quiet", False):
            from jaxsmol.system import progress

            progress.set_quiet()
        return parsed


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (they show only on a terminal, "
                   "for waits over 2 s: the kernels' compile, a model's import, programs compiled)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR|FILE.gguf", help="a Hugging Face SmolLM checkpoint directory, or a "
                   "GGUF file run as it is (F32, F16, BF16, Q8_0, Q4_1, Q4_0) (default: the bundled "
                   "SmolLM2-135M-Instruct: its Q4_1 file as it is where the CPU kernels run, else its float32 "
                   "values; imported on first use)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' dtype (the CPU kernels widen bfloat16 exactly and compute in float32)")
    p.add_argument("--quantize", default=None, choices=["q8_0", "q4_1", "none"],
                   help="run every matrix quantized, dequantized inside the matmul (GGUF's Q8_0: ~1.1 bytes a "
                        "weight; Q4_1: ~0.75, the unembedding at Q8_0); none: the float values (a GGUF's "
                        "dequantized). Default: as the model is; the bundled model runs its Q4_1 file as it is "
                        "where the CPU kernels run (1/6 of the memory; with --matmul exact the same logits as its "
                        "float32 values), float32 elsewhere")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16"],
                   help="the KV cache's dtype (default: float32, or bfloat16 with --dtype bfloat16 on XLA's path): "
                        "bfloat16 halves the cache and its snapshots, so the prefix cache holds twice the tokens")
    p.add_argument("--matmul", default="auto", choices=["auto", "exact", "int8"],
                   help="how quantized weights multiply: exact (the float32 bits of their values), or int8 "
                        "(activations rounded to 8 bits per 32 values, integer dot products, as llama.cpp does: "
                        "logprobs within ~0.2-0.4 of the float32 weights', 1.5-2x faster matmuls); auto (the "
                        "default): int8 where the CPU kernels run")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (heads and MLP columns)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel devices (the batch)")
    add_quiet_arg(p)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                   "probabilities sum to p (1 = all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed: one seed, one output")


def add_speculate_args(p: argparse.ArgumentParser) -> None:
    from jaxsmol.cache.scheduler.speculation_modes import SPECULATE_MODES, VERIFY_ROWS

    p.add_argument("--speculate", choices=SPECULATE_MODES, default="auto",
                   help="draft tokens and verify them in one step, the output unchanged bit for bit: ngram = "
                        "from the request's own prompt and output (and the tokens a JSON schema forces); cache = "
                        "those and what the prefix cache stored after the prompt (an earlier answer); draft = "
                        "a draft model's (--draft-model), cache's first where an n-gram recurs; auto (default) = "
                        "draft with --draft-model, else cache where the CPU kernels run, none elsewhere; none = "
                        "one token per step")
    p.add_argument("--draft-model", metavar="PATH", help="a smaller model with the same tokenizer (a checkpoint "
                   "directory or a GGUF file, loaded as the model is) that drafts tokens for --speculate draft / auto")
    p.add_argument("--speculate-tokens", type=int, default=7, metavar="K",
                   help=f"the most drafted tokens a row verifies in one step, 1-{VERIFY_ROWS[-1] - 1} (default 7)")


def add_structured_args(p: argparse.ArgumentParser) -> None:
    s = p.add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching the JSON schema in FILE "
                   "(enforced token by token)")
    s.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    s.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")


def structured_spec(args) -> str | None:
    """SamplingParams.structured from --json-schema / --json-object / --regex (checked, before the model loads)."""
    from jaxsmol.errors import JaxsmolError
    from jaxsmol.runtime.structured import canonical_spec

    if getattr(args, "json_object", False):
        return canonical_spec({"type": "json_object"})
    if getattr(args, "regex", None) is not None:
        return canonical_spec({"type": "regex", "regex": args.regex})
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise JaxsmolError(f"cannot read schema file {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JaxsmolError(f"schema file {path} is not valid JSON: {e}") from None
    return canonical_spec({"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}})


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def load_engine(args, on_config=None):
    from jaxsmol.runtime.engine import Engine

    from jaxsmol.runtime.compile_cache import enable_compilation_cache

    enable_compilation_cache()
    mesh = None
    if args.tp * args.dp > 1 or args.tp < 1 or args.dp < 1:
        from jaxsmol.model.sharding import make_mesh
        mesh = make_mesh(tp=args.tp, dp=args.dp)
    with progress.Wait(f"loading {args.model or 'the bundled model'}"):
        return Engine.load(args.model, ctx=args.ctx, dtype=args.dtype, quantize=getattr(args, "quantize", None),
                           kv_dtype=getattr(args, "kv_dtype", None), matmul=getattr(args, "matmul", "auto"),
                           progress=progress.shown(), mesh=mesh, on_config=on_config)


def check_speculate(args) -> None:
    """Refuse --speculate and --draft-model values that do not go together, before any model loads."""
    from jaxsmol.errors import JaxsmolError

    if args.draft_model and args.speculate not in ("auto", "draft"):
        raise JaxsmolError(f"--draft-model drafts only with --speculate draft or auto, not {args.speculate}")
    if args.speculate == "draft" and not args.draft_model:
        raise JaxsmolError("--speculate draft needs --draft-model PATH")


def load_draft(args, engine):
    """The --draft-model engine (loaded as the model is: --dtype, --kv-dtype, --matmul, on one device), or None."""
    if not args.draft_model:
        return None
    from jaxsmol.cache.scheduler.draft_model import check_pair
    from jaxsmol.errors import JaxsmolError
    from jaxsmol.runtime.engine import Engine

    try:
        draft = Engine.load(args.draft_model, ctx=engine.ctx, dtype=args.dtype,
                            kv_dtype=getattr(args, "kv_dtype", None), matmul=getattr(args, "matmul", "auto"),
                            progress=progress.shown())
        check_pair(draft, engine)
    except JaxsmolError as e:
        raise JaxsmolError(f"--draft-model {args.draft_model}: {e}") from None
    return draft


class Precompile:
    """Compile a one-shot request's programs in a thread while the weights load (`jaxsmol generate`).

    `start` is Engine.load's on_config hook: with the config and tokenizer known, it encodes the
    prompt and compiles the programs of a lone request of that length (compile_ahead.compile_lone_request),
    or from the persistent compilation cache when they are there. `wait` returns the thread's wall
    time. A failure here is not an error: the programs are then compiled on first use. Used as a
    context manager, it waits for the thread when the request fails: a process that exits while XLA
    compiles in a thread aborts ("terminate called ...") instead of exiting with its error."""

    def __init__(self, args):
        self.args = args
        self.thread, self.seconds = None, 0.0

    def start(self, cfg, tokenizer) -> None:
        import threading
        import types

        from jaxsmol.runtime.engine import check_prompt, context_length
        from jaxsmol.errors import JaxsmolError

        a = self.args
        if a.prompt_cache or a.tp * a.dp > 1:  # a restored prefix or a sharded layout: other programs
            return
        ids = prompt_ids(a, types.SimpleNamespace(tokenizer=tokenizer, cfg=cfg))
        try:
            ids = check_prompt(cfg, context_length(cfg, a.ctx), ids, a.max_tokens)
        except JaxsmolError:
            return  # the engine will refuse this request, and say why: nothing to compile
        self.thread = threading.Thread(target=self._compile, args=(cfg, context_length(cfg, a.ctx), len(ids)),
                                       daemon=True)
        self.thread.start()

    def _compile(self, cfg, ctx: int, n: int) -> None:
        import time

        from jaxsmol.cache.scheduler.compile_ahead import compile_lone_request

        t0 = time.perf_counter()
        try:
            compile_lone_request(cfg, self.args.dtype, ctx, n, self.args.max_tokens, self.args.speculate,
                                 bool(self.args.draft_model))
        except Exception:  # noqa: BLE001 - compiled on first use instead
            pass
        self.seconds = time.perf_counter() - t0

    def wait(self) -> float:
        if self.thread is not None:
            self.thread.join()
        return self.seconds

    def __enter__(self) -> Precompile:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


def prompt_ids(args, engine) -> list[int]:
    """Token ids from --ids, or from the text prompt (through the chat template with --chat)."""
    from jaxsmol.errors import JaxsmolError

    if getattr(args, "ids", None):
        return args.ids
    text = args.prompt
    if text is None or text == "":
        raise JaxsmolError("the prompt is empty (give a text prompt or --ids)")
    if getattr(args, "chat", False):
        messages = ([{"role": "system", "content": args.system}] if getattr(args, "system", None) else [])
        text = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def add_prompt_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-cache", metavar="FILE",
                   help="reuse the prompt prefix saved in FILE (if it is there and fits this model), "
                        "then save this request's state to it")


def open_prompt_cache(engine, path, prompt, mode: str = "radix"):
    """(PrefixCache seeded from FILE, PromptCacheReport) for --prompt-cache. A file that cannot be used
    is a one-line warning on stderr; the request then runs cold."""
    from jaxsmol.cache.store.disk import load_prompt_cache
    from jaxsmol.cache.prefix_cache import PrefixCache

    cache = PrefixCache(engine, mode=mode)
    report = load_prompt_cache(cache, path, prompt)
    if report.refused:
        print(f"warning: prompt cache not used: {report.refused}", file=sys.stderr)
    return cache, report


def warn_refused(probe_result: dict) -> None:
    refused = (probe_result.get("prompt_cache") or {}).get("refused")
    if refused:
        print(f"warning: prompt cache not used: {refused}", file=sys.stderr)


def close_prompt_cache(cache, report, tokens) -> None:
    """Save the state of `tokens` (the prompt, plus the answer where stored) to the prompt cache file;
    a file that is not a snapshot is left as it is (the warning when it was refused said so)."""
    from jaxsmol.cache.store.disk import save_prompt_cache
    from jaxsmol.errors import JaxsmolError

    try:
        save_prompt_cache(cache, report.file, tokens, report)
    except (OSError, JaxsmolError) as e:
        print(f"warning: cannot write prompt cache {report.file}: {e}", file=sys.stderr)


def user_errors(main):
    """Turn JaxsmolError (and a few OS errors) into `error: ...` on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapper(argv=None):
        from jaxsmol.errors import JaxsmolError

        try:
            return main(argv)
        except JaxsmolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return 0
        except Exception as e:  # a bug: still one line, the traceback on request
            if os.environ.get("JAXSMOL_DEBUG"):
                raise
            print(f"error: internal error: {type(e).__name__}: {e} (set JAXSMOL_DEBUG=1 for the traceback)",
                  file=sys.stderr)
            return 1
    return wrapper
