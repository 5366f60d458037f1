"""jaxsmol: a pure-functional JAX inference engine for SmolLM models.

    from jaxsmol import Engine, SamplingParams
    from jaxsmol.cache import PrefixCache, generate
    engine = Engine.load()                      # the bundled SmolLM2-135M-Instruct, or Engine.load(DIR)
    out = generate(PrefixCache(engine), engine.tokenizer.encode("The capital of France is"),
                   SamplingParams(max_tokens=8))   # or generate(engine, ...): no prefix cache
    print(out.text)

Subpackages, each importing only those before it in this list (tests/test_imports.py checks it):
  system/      process plumbing: data directories, durable writes, host memory, program memory
  kernels/     the C++ CPU kernels (matmul, attention, prefix copy) and their loader
  model/       the Llama model as pure functions: Config, Params, the KV pytree, rope, the forward, sharding
  checkpoint/  getting a model directory: the tokenizer, the GGUF import, the bundled default model
  runtime/     running it: Engine (restore, prefill, decode), batched decode, the jitted programs, sampling, streams,
               structured output, scoring, compile cache
`errors.py` (the one user-facing error type) may be imported from anywhere.
Two more subpackages live in the repository's top-level folders and install here (pyproject.toml's
package-dir): jaxsmol.cache (cache/, the prefix cache and the scheduler) and jaxsmol.cli (cli/, the
commands and the daemon); nothing above imports them. Requests (the library's, the command line's and
the daemon's) run through jaxsmol.cache's scheduler.
"""

__all__ = ["Config", "Engine", "JaxsmolError", "KVCache", "SamplingParams", "canonical_spec",
           "enable_compilation_cache", "make_mesh", "score"]
# The public names, imported when first asked for: `import jaxsmol` (and the command line's `--help`,
# `info`, `cache ls`) loads no jax until a name that needs it is used.
_PUBLIC = {"Config": "jaxsmol.model.config", "Engine": "jaxsmol.runtime.engine", "JaxsmolError": "jaxsmol.errors",
           "KVCache": "jaxsmol.model.kv", "SamplingParams": "jaxsmol.runtime.sampling",
           "canonical_spec": "jaxsmol.runtime.structured", "enable_compilation_cache": "jaxsmol.runtime.compile_cache",
           "make_mesh": "jaxsmol.model.sharding", "score": "jaxsmol.runtime.scoring"}


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxsmol' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__():
    return sorted([*globals(), *_PUBLIC])
