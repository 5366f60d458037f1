"""Running the model: Engine (engine.py: load, prefill, restore, decode), its load options (load_options.py:
weight format, matmul class), batched rows (batch.py), the KV arena they live in (kv_arena.py; its size:
arena_size.py; its users' handles: arena_handles.py), every jitted program (programs.py, the one place
`jax.jit` is applied), prompt chunk shapes (chunks.py), reusable buffers (buffers.py), sampling (sampling.py),
token streams to text (stream.py), structured output (structured.py), scoring (scoring.py), and compiled
programs kept on disk (compile_cache.py, program_store.py) and compiled in child processes (compile_apart.py).
Imports: everything else in jaxsmol."""
