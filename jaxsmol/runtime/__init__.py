"""Running the model: Engine (engine.py: load, prefill, restore, decode), its load options (load_options.py:
weight format, matmul class), batched rows (batch.py), every jitted program (programs.py, the one place
`jax.jit` is applied), prompt chunk shapes (chunks.py), reusable buffers (buffers.py), sampling (sampling.py),
token streams to text (stream.py), structured output (structured.py), scoring (scoring.py), and compiled
programs kept on disk (compile_cache.py, program_store.py) and compiled in a child process (compile_apart.py).
Imports: everything else in jaxsmol."""
