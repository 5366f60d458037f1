"""`--compare hf`: the same prefill, decode and prefix reuse with Hugging Face transformers (torch)."""

from __future__ import annotations

import copy
import importlib.util

from jaxsmol.cli.bench.measure import Warmup, log, measure_decode, measure_prefill, median, now, timed
from jaxsmol.cli.bench.plans import HEADLINE, rand_ids, two_suffixes


def hf_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


class HFModel:
    """The checkpoint in transformers' LlamaForCausalLM (float32), timed the way jaxsmol is."""

    def __init__(self, model_dir):
        import inspect
        import warnings

        import torch
        import transformers
        from transformers import LlamaForCausalLM

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)
        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
        params = inspect.signature(self.model.forward).parameters
        # only the last position's logits, like jaxsmol (and HF's own generate) computes
        self.last = ({"logits_to_keep": 1} if "logits_to_keep" in params else
                     {"num_logits_to_keep": 1} if "num_logits_to_keep" in params else {})
        # the KV cache argument: `cache` in recent transformers, `past_key_values` before
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward(self, ids, past=None):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([ids]), use_cache=True, **{self.cache_arg: past}, **self.last)
        past = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        return int(out.logits[0, -1].argmax()), past

    def prefill(self, ids) -> float:
        t0 = now()
        self.forward(ids)
        return now() - t0

    def decode(self, position: int, steps: int, rng, vocab) -> float:
        token, past = self.forward(rand_ids(rng, position, vocab))
        t0 = now()
        for _ in range(steps):
            token, past = self.forward([token], past)
        return (now() - t0) / steps

    def reuse(self, prefix, suffix) -> tuple[float, float]:
        """(cold TTFT of prefix + suffix, warm TTFT from a copy of the prefix's DynamicCache)."""
        t0 = now()
        self.forward(prefix + suffix)
        cold = now() - t0
        _, past = self.forward(prefix)
        t0 = now()
        self.forward(suffix, copy.deepcopy(past))
        return cold, now() - t0


def _one_round(engine, hf: HFModel, plan, rng, sizes, positions, add) -> None:
    """One measurement of each metric with each engine, alternating."""
    from jaxsmol.cache.prefix_cache import PrefixCache

    vocab, steps = engine.cfg.vocab_size, plan["decode_steps"]
    p, s = HEADLINE
    for n in sizes:
        ids = rand_ids(rng, n, vocab)
        add(f"prefill {n} (tok/s)", n / measure_prefill(engine, ids), n / hf.prefill(ids))
    for q in positions:
        add(f"decode at {q} (tok/s)", 1 / measure_decode(engine, q, steps), 1 / hf.decode(q, steps, rng, vocab))
    prefix = rand_ids(rng, p, vocab)
    a, b = two_suffixes(rng, s, vocab)
    cache = PrefixCache(engine)
    j_cold = timed(cache, prefix + a)["ttft_s"]
    j_warm = timed(cache, prefix + b)["ttft_s"]
    h_cold, h_warm = hf.reuse(prefix, b)
    add(f"ttft cold {p}+{s} (ms)", j_cold * 1000, h_cold * 1000)
    add(f"ttft warm {p}+{s} (ms)", j_warm * 1000, h_warm * 1000)
    add(f"warm/cold {p}+{s}", j_warm / j_cold, h_warm / h_cold)


def section_hf(engine, plan, rng, warm: Warmup) -> dict:
    import torch
    import transformers

    hf = HFModel(engine.model_dir)
    steps = plan["decode_steps"]
    sizes = [n for n in plan["hf_prefill"] if n + 1 <= engine.ctx]
    positions = [p for p in plan["decode_positions"] if p + steps + 1 <= engine.ctx]
    p, s = HEADLINE
    for n in sizes:
        warm.request(n)
    for q in positions:
        warm.request(q, max_tokens=steps + 1)
    warm.request(p + s, generated=1)
    warm.request(p + s, start=p, generated=1)
    hf.forward([100, 101])  # torch's first call sets things up
    samples: dict[str, dict[str, list]] = {}

    def add(name, j, h):
        d = samples.setdefault(name, {"jaxsmol": [], "hf": []})
        d["jaxsmol"].append(j)
        d["hf"].append(h)

    for _ in range(plan["hf_repeats"]):  # alternate the two engines, measurement by measurement
        _one_round(engine, hf, plan, rng, sizes, positions, add)
    rows = []
    for name, d in samples.items():
        j, h = median(d["jaxsmol"]), median(d["hf"])
        rows.append({"metric": name, "jaxsmol": j, "hf": h, "jaxsmol_over_hf": j / h,
                     "higher_is_better": "tok/s" in name})
        log(f"hf {name}: jaxsmol {j:.4g}, hf {h:.4g}")
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "dtype": "float32", "repeats": plan["hf_repeats"],
            "rows": rows}
