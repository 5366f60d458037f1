"""`aitest`: the course exercise's client.

    aitest --cacheprobe --predict N ID...       cold run, then warm run, side by side
    aitest --predict N ID...                    one request; prints the generated ids
    aitest --url http://127.0.0.1:8000 ...      the same against a running `jaxsmol serve`

Without --url the model runs in this process. The course exercise's daemon keeps one snapshot of the first
prompt_n - 1 tokens, so the in-process default cache mode is `single`; `--cache-mode radix`
uses the full prefix store.
"""

from __future__ import annotations

import json
import sys

from jaxsmol.cli.common import (ArgumentParser, add_model_args, add_sampling_args, close_prompt_cache, load_engine,
                                open_prompt_cache, warn_refused, sampling_kwargs, user_errors)
from jaxsmol.cli.main import add_probe_args
from jaxsmol.cli.tables import format_probe


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="aitest", description="The test client of the prefix-cache course exercise.")
    p.add_argument("ids", type=int, nargs="+", metavar="ID", help="prompt token ids")
    p.add_argument("--cacheprobe", action="store_true", help="run the request cold, then warm, and compare")
    p.add_argument("--url", help="send the requests to a running `jaxsmol serve` at this address")
    add_probe_args(p, default_mode="single")
    add_sampling_args(p)
    add_model_args(p)
    return p


@user_errors
def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.predict < 0:
        p.error(f"--predict must be >= 0, got {args.predict}")
    if args.url and args.prompt_cache:
        p.error("--prompt-cache runs the model in this process; it does not go with --url")
    if args.url and args.speculate != "auto":
        p.error("--speculate sets this process's runs; with --url the daemon's own --speculate applies")
    if args.url:
        from jaxsmol.cli.client import complete, remote_probe

        if args.cacheprobe:
            result = remote_probe(args.url, args.ids, args.predict, then_ids=args.then)
            print(json.dumps(result) if args.json else format_probe(result))
        else:
            out = complete(args.url, args.ids, args.predict)
            print(json.dumps(out) if args.json else " ".join(map(str, out["output_ids"])))
        return 0
    engine = load_engine(args)
    if args.cacheprobe:
        from jaxsmol.cache.probe import run_probe

        result = run_probe(engine, args.ids, args.predict, mode=args.cache_mode, then_ids=args.then,
                           speculate=args.speculate,
                           budget_bytes=args.cache_bytes, prompt_cache=args.prompt_cache, **sampling_kwargs(args))
        warn_refused(result)
        print(json.dumps(result) if args.json else format_probe(result))
        return 0
    from jaxsmol.cache import generate
    from jaxsmol.runtime.sampling import SamplingParams

    sp = SamplingParams(max_tokens=args.predict, **sampling_kwargs(args))
    cache_out = None
    if args.prompt_cache:
        ids = engine.check_prompt(args.ids, args.predict)
        cache, pc = open_prompt_cache(engine, args.prompt_cache, ids, mode=args.cache_mode)
        gen = generate(cache, ids, sp)
        close_prompt_cache(cache, pc, ids + gen.output_ids)
        cache_out = {"reused": gen.report.reused, "source": "prompt-cache" if gen.report.reused else None,
                     "refused": pc.refused, "file": pc.file, "saved": pc.saved}
    else:
        gen = generate(engine, args.ids, sp)
    if args.json:
        out = {"prompt_ids": args.ids, "output_ids": gen.output_ids, "text": gen.text,
               "timings": gen.timings.as_dict()}
        if cache_out is not None:
            out["cache"] = cache_out
        print(json.dumps(out))
    else:
        print(" ".join(map(str, gen.output_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
