"""`jaxsmol`: generate, tokenize, cacheprobe, score, serve, cluster, cache, bench, import-gguf, quantize, info."""

from __future__ import annotations

import json
import sys
import time

from jaxsmol.cli.common import (ArgumentParser, Precompile, add_model_args, add_prompt_cache_arg, add_quiet_arg,
                                add_sampling_args, add_speculate_args, add_structured_args, check_speculate,
                                close_prompt_cache, load_draft, load_engine, open_prompt_cache, prompt_ids,
                                sampling_kwargs, structured_spec, user_errors, warn_refused)
from jaxsmol.cache.scheduler.speculation_modes import SPECULATE_MODES
from jaxsmol.cli.tables import format_probe, format_scores
from jaxsmol.system import progress


def _generate(args) -> int:
    from jaxsmol.cache import generate
    from jaxsmol.runtime.sampling import SamplingParams

    structured = structured_spec(args)  # a bad schema fails before the model loads
    check_speculate(args)
    sp = SamplingParams(max_tokens=args.max_tokens, stop_strings=tuple(args.stop or ()),  # so do bad settings
                        logprobs=args.logprobs, structured=structured, **sampling_kwargs(args))
    t0 = time.perf_counter()
    with Precompile(args) as precompile:  # the request's programs, while the weights load
        engine = load_engine(args, on_config=precompile.start)
        load_s = time.perf_counter() - t0
        ids = engine.check_prompt(prompt_ids(args, engine), args.max_tokens)
        draft = load_draft(args, engine)
        compile_s = precompile.wait()
    startup_s = time.perf_counter() - t0
    cache = None
    if args.prompt_cache:
        cache, pc = open_prompt_cache(engine, args.prompt_cache, ids)
    stream = not args.json and not args.no_stream

    def show(step) -> None:
        sys.stdout.write(step.text)
        sys.stdout.flush()

    gen = generate(cache or engine, ids, sp, speculate=args.speculate, speculate_tokens=args.speculate_tokens,
                   draft=draft, on_token=show if stream else None)
    t = gen.timings
    t.load_s, t.compile_s, t.startup_s = load_s, compile_s, startup_s
    cache_out = None
    if args.prompt_cache:
        close_prompt_cache(cache, pc, ids + gen.output_ids)
        cache_out = {"reused": gen.report.reused, "source": "prompt-cache" if gen.report.reused else None,
                     "refused": pc.refused, "file": pc.file, "saved": pc.saved}
    if args.json:
        out = {"prompt_ids": ids, "output_ids": gen.output_ids, "text": gen.text,
               "finish_reason": gen.finish_reason, "timings": t.as_dict()}
        if cache_out is not None:
            out["cache"] = cache_out
        if args.logprobs:
            out["logprobs"] = [{"token": p["token"], "logprob": p["logprob"],
                                "top": [{"id": i, "logprob": lp} for i, lp in p["top"]]} for p in gen.logprobs]
        print(json.dumps(out))
    else:
        print(gen.text if not stream else "")
        print(f"[{t.prompt_tokens} prompt tokens, {t.generated_tokens} generated ({gen.finish_reason}); "
              f"load {t.load_s:.2f} s, compile {t.compile_s:.2f} s (while loading), "
              f"ttft {t.ttft_s * 1000:.0f} ms, prefill {t.prefill_tok_s:.0f} tok/s, "
              f"decode {t.decode_tok_s:.1f} tok/s]", file=sys.stderr)
        if cache_out is not None:
            print(f"[prompt cache {cache_out['file']}: {cache_out['reused']} of {t.prompt_tokens} prompt tokens "
                  f"reused, {cache_out['saved']} tokens saved]", file=sys.stderr)
    return 0


def _tokenize(args) -> int:
    from jaxsmol.checkpoint.default_model import default_model_dir
    from jaxsmol.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer.load(args.model or default_model_dir(progress=progress.shown(), lean=True))
    text = tok.apply_chat_template([{"role": "user", "content": args.text}]) if args.chat else args.text
    ids = tok.encode(text)
    if args.json:
        print(json.dumps({"ids": ids, "tokens": [tok.decode([i]) for i in ids]}))
    else:
        print(" ".join(map(str, ids)))
    return 0


def _import_gguf(args) -> int:
    from jaxsmol.checkpoint.gguf_import import import_gguf

    out = import_gguf(args.file, args.outdir, progress=progress.shown())
    print(f"imported {args.file} -> {out}")
    return 0


def _quantize(args) -> int:
    from jaxsmol.checkpoint.gguf_export import export_gguf

    t0 = time.perf_counter()
    out = export_gguf(args.model, args.out, args.type, force=args.force, progress=progress.shown())
    print(f"wrote {out} ({args.type}, {out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0


def _cacheprobe(args) -> int:
    from jaxsmol.cache.probe import run_probe

    engine = load_engine(args)
    ids = prompt_ids(args, engine)
    result = run_probe(engine, ids, args.predict, mode=args.cache_mode, then_ids=args.then,
                       budget_bytes=args.cache_bytes, prompt_cache=args.prompt_cache, speculate=args.speculate,
                       **sampling_kwargs(args))
    warn_refused(result)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_probe(result))
    return 0


def _serve(args) -> int:
    from jaxsmol.cache.scheduler.settings import CHUNK_ROWS_CHOICES, BatchSettings
    from jaxsmol.cache.store.shared import SharedStore, model_identity
    from jaxsmol.cli.serve_options import daemon_options, shared_backend
    from jaxsmol.cli.server.serve import serve
    from jaxsmol.cli.server.tenants import Tenants
    from jaxsmol.errors import JaxsmolError

    tenants = Tenants.from_options(args.api_key, args.api_keys)  # a bad keys file fails before the model loads
    check_speculate(args)
    if args.max_connections is not None and args.max_connections < 1:
        raise JaxsmolError(f"--max-connections must be >= 1, got {args.max_connections}")
    if args.write_timeout <= 0:
        raise JaxsmolError(f"--write-timeout must be > 0 seconds, got {args.write_timeout}")
    if not 1 <= args.max_batch <= 256:
        raise JaxsmolError(f"--max-batch must be in [1, 256], got {args.max_batch}")
    if args.prefill_chunk not in CHUNK_ROWS_CHOICES:
        raise JaxsmolError(f"--prefill-chunk must be one of {', '.join(map(str, CHUNK_ROWS_CHOICES))}, "
                           f"got {args.prefill_chunk}")
    if args.kv_cache_bytes <= 0:
        raise JaxsmolError(f"--kv-cache-bytes must be > 0, got {args.kv_cache_bytes}")
    if args.pinned_bytes < 0 or args.admission_bound < 0:
        raise JaxsmolError("--pinned-bytes and --admission-bound must be >= 0")
    if not tenants.enabled and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without API keys: anyone who can reach it shares the prefix "
              "cache (cached_tokens reveals what others sent) and may flush it", file=sys.stderr)
    options = daemon_options(args)  # a bad --read-timeout fails before the model loads
    backend = shared_backend(args)  # a bad URL or an unreachable server too
    engine = load_engine(args)
    shared = None if backend is None else SharedStore(backend, model_identity(engine), background=True,
                                                      write_back=args.shared_cache_write == "back")
    serve(engine, args.host, args.port, draft=load_draft(args, engine), cache_bytes=args.cache_bytes, **options,
          shared=shared,
          prefix_cache=not args.no_prefix_cache,
          max_queue=args.max_queue, cache_mode=args.cache_mode, cache_dir=args.cache_dir,
          disk_cache_bytes=args.disk_cache_bytes, tenants=tenants, max_connections=args.max_connections,
          write_timeout_s=args.write_timeout, warmup=args.warmup, pinned_bytes=args.pinned_bytes,
          batch=BatchSettings(max_batch=args.max_batch, kv_bytes=args.kv_cache_bytes,
                              batch_invariant=args.batch_invariant, chunk_rows=args.prefill_chunk,
                              admission=args.admission, admission_bound=args.admission_bound,
                              speculate=args.speculate, speculate_tokens=args.speculate_tokens))
    return 0


def _score(args) -> int:
    from jaxsmol.runtime.scoring import score

    engine = load_engine(args)
    ids = prompt_ids(args, engine)
    scores = score(engine, ids, args.top_k)
    tok = engine.tokenizer
    total = sum(s.logprob for s in scores[1:])
    if args.json:
        print(json.dumps({"ids": ids, "tokens": [tok.decode([i]) for i in ids],
                          "token_logprobs": [s.logprob for s in scores],
                          "ranks": [s.rank for s in scores],
                          "top_logprobs": [None if s.top is None else
                                           [{"id": i, "token": tok.decode([i]), "logprob": lp} for i, lp in s.top]
                                           for s in scores],
                          "sum_logprob": total}))
        return 0
    print(format_scores(scores, tok.decode))
    print(f"sum of log-probabilities: {total:.4f} over {len(scores) - 1} scored tokens")
    return 0


def _bench(args) -> int:
    from jaxsmol.cli.bench.run import run_bench

    return run_bench(args)


def add_probe_args(p, default_mode: str) -> None:
    p.add_argument("--predict", type=int, default=1, metavar="N", help="tokens to generate (default 1)")
    p.add_argument("--then", type=int, nargs="+", metavar="ID",
                   help="a second prompt (token ids) for the warm run, sharing a prefix with the first")
    p.add_argument("--cache-mode", default=default_mode, choices=["radix", "single", "off"],
                   help="radix: many prefixes in a radix tree; single: one snapshot of the first prompt_n - 1 tokens; "
                        "off: every request cold")
    p.add_argument("--cache-bytes", type=int, default=2 << 30, help="prefix cache budget in bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--speculate", default="auto", choices=[m for m in SPECULATE_MODES if m != "draft"],
                   help="how the runs speculate (see `jaxsmol generate --help`; the outputs are the same bits "
                        "either way): auto (default), none, ngram, cache")
    add_prompt_cache_arg(p)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", help="the prompt text")
    g.add_argument("--ids", type=int, nargs="+", metavar="ID", help="the prompt as token ids")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    g.add_argument("--system", help="a system message (with --chat)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("--logprobs", type=int, default=0, metavar="K", help="report the top-K log-probabilities")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-stream", action="store_true", help="print the text at the end")
    add_prompt_cache_arg(g)
    add_structured_args(g)
    add_sampling_args(g)
    add_speculate_args(g)
    add_model_args(g)
    g.set_defaults(func=_generate)


def _add_tokenize(sub) -> None:
    t = sub.add_parser("tokenize", help="print the token ids of a text")
    t.add_argument("text", help="the text to encode")
    t.add_argument("--chat", action="store_true", help="wrap the text in the model's chat template (a user turn)")
    t.add_argument("--json", action="store_true", help="print the ids as a JSON list")
    t.add_argument("--model", metavar="DIR", help="a checkpoint directory (default: the bundled model)")
    add_quiet_arg(t)
    t.set_defaults(func=_tokenize)


def _add_cacheprobe(sub) -> None:
    c = sub.add_parser("cacheprobe", help="run a request cold, then warm from the prefix cache")
    c.add_argument("ids", type=int, nargs="*", metavar="ID", help="the prompt as token ids")
    c.add_argument("--text", dest="prompt", help="the prompt as text")
    c.add_argument("--chat", action="store_true", help="apply the chat template to --text")
    add_probe_args(c, default_mode="radix")
    add_sampling_args(c)
    c.set_defaults(max_tokens=None)
    add_model_args(c)
    c.set_defaults(func=_cacheprobe)


def _add_serve(sub) -> None:
    from jaxsmol.cli.serve_options import add_serve_options

    s = sub.add_parser("serve", help="run the OpenAI-compatible daemon (keeps the prefix cache)")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    s.add_argument("--port", type=int, default=8000, help="the port to listen on")
    add_serve_options(s)
    s.set_defaults(func=_serve)


def _add_cluster(sub) -> None:
    from jaxsmol.cli.cluster import add_cluster_parser

    add_cluster_parser(sub)
    sub.choices["cluster"].set_defaults(func=_cluster)


def _cluster(args) -> int:
    from jaxsmol.cli.cluster import run_cluster

    return run_cluster(args)


def _add_score(sub) -> None:
    sc = sub.add_parser("score", help="the log-probability of every token of a text given the tokens before it")
    sc.add_argument("prompt", nargs="?", help="the text to score")
    sc.add_argument("--ids", type=int, nargs="+", metavar="ID", help="the tokens to score, as ids")
    sc.add_argument("--chat", action="store_true", help="apply the model's chat template to the text")
    sc.add_argument("--top-k", type=int, default=0, metavar="K", help="also the K most likely tokens at each position")
    sc.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(sc)
    sc.set_defaults(func=_score)


def _add_bench(sub) -> None:
    from jaxsmol.cli.bench.plans import EXTRA_SECTIONS, SECTIONS, add_section_flags

    b = sub.add_parser("bench", help="benchmark prefill, decode, prefix reuse, snapshot memory and compilations; "
                       "with --only, also forks, the prompt cache on disk, TTFT and serving against a peer server",
                       description="Every benchmark a user runs. The default run (no --only) is the sections "
                       f"{', '.join(SECTIONS)}. The sections {', '.join(EXTRA_SECTIONS)} run only when named in "
                       "--only (each takes minutes at its full sizes; serve and first-burst start `jaxsmol serve` "
                       "daemons on free loopback ports and stop them). See cli/bench/__init__.py.")
    b.add_argument("--quick", action="store_true", help="fewer sizes and repeats (well under 2 minutes)")
    b.add_argument("--json", default="bench.json", metavar="FILE", help="write the results here (default bench.json)")
    b.add_argument("--plot", metavar="FILE", help="also draw the results into a PNG (needs matplotlib)")
    b.add_argument("--compare", choices=["hf"], help="also measure Hugging Face transformers (pip install -e '.[hf]')")
    b.add_argument("--only", nargs="+", metavar="SECTION", choices=SECTIONS + EXTRA_SECTIONS,
                   help=f"run only these sections: {', '.join(SECTIONS)} (the default run), or "
                        f"{', '.join(EXTRA_SECTIONS)} (only when named here)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    b.add_argument("--peer-url", metavar="URL", help="serve, ttft-peer and speculate: also measure this "
                   "OpenAI-compatible server (e.g. llama.cpp's llama-server), alternating with jaxsmol")
    b.add_argument("--draft-model", metavar="PATH", help="speculate: also measure this draft model's drafts "
                   "(--speculate draft; a checkpoint directory or GGUF file with the model's tokenizer)")
    add_section_flags(b)
    add_model_args(b)
    b.set_defaults(func=_bench)


def _info(args) -> int:
    from jaxsmol.cli.info import run_info

    return run_info(args)


def _add_info(sub) -> None:
    i = sub.add_parser("info", help="versions, backend and devices, the CPU kernels' state, the model and data "
                       "directories (JAXSMOL_KERNELS=auto|on|off switches the kernels)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--load", action="store_true", help="also start JAX (its devices), load the CPU kernels (compiling "
                   "them where they must be) and size the weights; without it, files alone are read (no jax)")
    i.set_defaults(func=_info)


def _add_import_gguf(sub) -> None:
    i = sub.add_parser("import-gguf", help="import a Llama-architecture GGUF into a Hugging Face directory")
    i.add_argument("file", help="the GGUF file (any type gguf-py dequantizes; the directory holds float32)")
    i.add_argument("outdir", help="the directory to write (must not exist, or be empty)")
    add_quiet_arg(i)
    i.set_defaults(func=_import_gguf)


def _add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="save a checkpoint as a GGUF file (Q8_0, Q4_1 or F32) that jaxsmol runs "
                       "as it is (the weights of --quantize TYPE) and llama.cpp loads")
    q.add_argument("model", metavar="DIR", help="a Hugging Face Llama checkpoint directory (or a GGUF file: "
                   "requantized from its float values, as --quantize does)")
    q.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write (written beside it, then renamed)")
    q.add_argument("--type", default="q8_0", metavar="q8_0|q4_1|f32",
                   help="q8_0 or q4_1: the layers' matrices quantized as --quantize does (the token table at "
                        "Q8_0, the norms F32); f32: every tensor float32 (default q8_0)")
    q.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_quiet_arg(q)
    q.set_defaults(func=_quantize)


def _add_cache(sub) -> None:
    from jaxsmol.cli.cache_tool import add_cache_parser

    add_cache_parser(sub)


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml), or "unknown" for a checkout not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxsmol")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="jaxsmol", description="A JAX inference engine for SmolLM with a prefix cache.")
    parser.add_argument("--version", action="version", version=f"jaxsmol {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for add in (_add_generate, _add_tokenize, _add_cacheprobe, _add_serve, _add_cluster, _add_cache, _add_score,
                _add_bench, _add_import_gguf, _add_quantize, _add_info):
        add(sub)
    return parser


@user_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxsmol.system.host_memory import one_malloc_arena  # after parsing: --help needs none of it

    one_malloc_arena()  # one high-water mark for all threads (see jaxsmol/system/host_memory.py)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
