"""jaxsmol: a pure-functional JAX inference engine for SmolLM models.

    from jaxsmol import Engine, SamplingParams
    engine = Engine.load()                      # the bundled SmolLM2-135M-Instruct, or Engine.load(DIR)
    gen = engine.generate(engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=8))
    print(gen.text)
"""

from jaxsmol.config import Config
from jaxsmol.engine import Engine, Generation
from jaxsmol.errors import JaxsmolError
from jaxsmol.kv import KVCache
from jaxsmol.sampling import SamplingParams

__all__ = ["Config", "Engine", "Generation", "JaxsmolError", "KVCache", "SamplingParams"]
