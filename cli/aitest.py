"""`aitest`: the lab's client. `aitest --cacheprobe --predict N ID...` runs the cold/warm probe;
`aitest --predict N ID...` runs one request and prints the generated ids.

The lab's daemon keeps one snapshot of the first prompt_n - 1 tokens, so the default cache mode
here is `minimal`; `--cache-mode radix` uses the full prefix store.
"""

from __future__ import annotations

import json
import sys

from cli.common import ArgumentParser, add_model_args, add_sampling_args, load_engine, sampling_kwargs, user_errors
from cli.main import add_probe_args, print_probe


@user_errors
def main(argv=None) -> int:
    p = ArgumentParser(prog="aitest", description="The prefix-cache lab's test client.")
    p.add_argument("ids", type=int, nargs="+", metavar="ID", help="prompt token ids")
    p.add_argument("--cacheprobe", action="store_true", help="run the request cold, then warm, and compare")
    add_probe_args(p, default_mode="minimal")
    add_sampling_args(p)
    add_model_args(p)
    args = p.parse_args(argv)
    engine = load_engine(args)
    if args.cacheprobe:
        from cache.probe import run_probe

        result = run_probe(engine, args.ids, args.predict, mode=args.cache_mode, then_ids=args.then,
                           budget_bytes=args.cache_bytes, **sampling_kwargs(args))
        print(json.dumps(result)) if args.json else print_probe(result)
        return 0
    from jaxsmol.sampling import SamplingParams

    gen = engine.generate(args.ids, SamplingParams(max_tokens=args.predict, **sampling_kwargs(args)))
    if args.json:
        print(json.dumps({"prompt_ids": args.ids, "output_ids": gen.output_ids, "text": gen.text,
                          "timings": gen.timings.as_dict()}))
    else:
        print(" ".join(map(str, gen.output_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
