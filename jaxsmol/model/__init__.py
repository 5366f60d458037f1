"""The Llama model as pure functions and registered pytrees: Config (config.py), Params and their loading
from safetensors (params.py), the KV cache pytree (kv.py; its slot axis: kv_layout.py), rotary embeddings
(rope.py), the forward (forward.py: (params, tokens, length, kv) -> (logits, kv)) and the device mesh
(sharding.py).
Nothing here is jitted (runtime/programs.py is). Imports: jaxsmol.kernels, jaxsmol.system, jaxsmol.errors."""
