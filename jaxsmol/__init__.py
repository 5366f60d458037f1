"""jaxsmol: a pure-functional JAX inference engine for SmolLM models.

    from jaxsmol import Engine, SamplingParams
    engine = Engine.load()                      # the bundled SmolLM2-135M-Instruct, or Engine.load(DIR)
    gen = engine.generate(engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=8))
    print(gen.text)

Subpackages, each importing only those before it in this list (tests/test_imports.py checks it):
  system/      process plumbing: data directories, durable writes, host memory, program memory
  kernels/     the C++ CPU kernels (matmul, attention, prefix copy) and their loader
  model/       the Llama model as pure functions: Config, Params, the KV pytree, rope, the forward, sharding
  checkpoint/  getting a model directory: the tokenizer, the GGUF import, the bundled default model
  runtime/     running it: Engine, generation, batched decode, the jitted programs, sampling, streams,
               structured output, scoring, compile cache
`errors.py` (the one user-facing error type) may be imported from anywhere.
"""

from jaxsmol.errors import JaxsmolError
from jaxsmol.model.config import Config
from jaxsmol.model.kv import KVCache
from jaxsmol.model.sharding import make_mesh
from jaxsmol.runtime.compile_cache import enable_compilation_cache
from jaxsmol.runtime.engine import Engine, Generation
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.scoring import score
from jaxsmol.runtime.structured import canonical_spec
from jaxsmol.system.moved_modules import keep_old_paths

__all__ = ["Config", "Engine", "Generation", "JaxsmolError", "KVCache", "SamplingParams", "canonical_spec",
           "enable_compilation_cache", "make_mesh", "score"]

# the flat layout of 0.1 (jaxsmol.engine, ...); jaxsmol.model is now the package (the forward: model.forward)
keep_old_paths({
    "jaxsmol.config": "jaxsmol.model.config",
    "jaxsmol.params": "jaxsmol.model.params",
    "jaxsmol.kv": "jaxsmol.model.kv",
    "jaxsmol.rope": "jaxsmol.model.rope",
    "jaxsmol.sharding": "jaxsmol.model.sharding",
    "jaxsmol.cpu_kernels": "jaxsmol.kernels.cpu_kernels",
    "jaxsmol.gguf_import": "jaxsmol.checkpoint.gguf_import",
    "jaxsmol.default_model": "jaxsmol.checkpoint.default_model",
    "jaxsmol.tokenizer": "jaxsmol.checkpoint.tokenizer",
    "jaxsmol.engine": "jaxsmol.runtime.engine",
    "jaxsmol.generation": "jaxsmol.runtime.generation",
    "jaxsmol.batch": "jaxsmol.runtime.batch",
    "jaxsmol.programs": "jaxsmol.runtime.programs",
    "jaxsmol.sampling": "jaxsmol.runtime.sampling",
    "jaxsmol.stream": "jaxsmol.runtime.stream",
    "jaxsmol.structured": "jaxsmol.runtime.structured",
    "jaxsmol.scoring": "jaxsmol.runtime.scoring",
    "jaxsmol.buffers": "jaxsmol.runtime.buffers",
    "jaxsmol.chunks": "jaxsmol.runtime.chunks",
    "jaxsmol.compile_cache": "jaxsmol.runtime.compile_cache",
    "jaxsmol.data_dirs": "jaxsmol.system.data_dirs",
    "jaxsmol.durable": "jaxsmol.system.durable",
    "jaxsmol.host_memory": "jaxsmol.system.host_memory",
    "jaxsmol.program_memory": "jaxsmol.system.program_memory",
})
