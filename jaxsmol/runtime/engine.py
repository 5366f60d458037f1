"""The engine: weights, tokenizer and the jitted forward; restore, chunked prefill and decode of a cache.

Requests are driven above it, by the scheduler (cache/scheduler/), the library's one at a time too.

Compiled programs come from programs.py (the one jit site). Prompts are prefilled in chunks whose lengths come from
buckets, with the true length traced. The scheduler's sequences live in rows of the engine's KV arena
(`arena`, kv_arena.py), whose programs have one shape whatever the lengths; the pure single-sequence
API below (`new_cache`, `prefill`, `decode`, `restore`) allocates caches with capacities from a doubling
ladder (chunks.py).

A prompt prefilled from a restored prefix gives exactly the bits of a prompt prefilled from zero, because a
prompt row's bits do not depend on the chunk that carries it: that makes the prefix cache exact. On XLA:CPU the
rows of `x @ W` are bit-identical for any row count >= 64 (not for 1..56), so every prefill chunk has at least
64 rows, wherever it starts, and attention blocks are aligned to absolute positions (see model.py). With the
CPU kernels (cpu_kernels.py; float32 or bfloat16 weights on one CPU device) every row of a chunk of >= 2 rows
gets the same bits whatever its size, so exact prefill may also use 8-, 16- and 32-row chunks: a short suffix
after a restore costs 8 rows, not 64. (Single rows are decode steps, whose attention takes another path.)
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.runtime.buffers import StagingBuffers
from jaxsmol.runtime.arena_size import DEFAULT_ROWS, rows_for
from jaxsmol.runtime.kv_arena import KVArena
from jaxsmol.runtime.compile_cache import enable_compilation_cache
from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime import programs
from jaxsmol.kernels import cpu_kernels, formats
from jaxsmol.model.kv import KVCache, check_snapshot
from jaxsmol.runtime.chunks import (IDLE_STEP_ROWS, PREFILL_BUCKETS, capacity_for, chunk_length, chunk_plan,
                                   prefill_buckets)
from jaxsmol.model.forward import ATTN_BLOCK
from jaxsmol.model.params import Params, load_params, params_from_hf
from jaxsmol.runtime.load_options import MATMULS, with_matmul, with_quantization  # noqa: F401 (MATMULS: the API's)
from jaxsmol.checkpoint.gguf_weights import GGUFFile
from jaxsmol.checkpoint.model_name import model_name
from jaxsmol.model.sharding import describe, kv_sharding, shard_params

# Rows of a scoring chunk (every position's logits): exact on XLA's matmul (>= 64) too, and its logits
# (64 x 49,152 floats: 12.6 MB) are what the process holds of them at once, whatever the prompt's length
SCORE_ROWS = 64


def compiled_programs(program: str = "forward") -> int:
    """How many programs the jitted `forward` (or `decode_step`, ...: see programs.py) has compiled in this
    process so far (programs.clear() resets it)."""
    return programs.compiled_count(program)


def _next_chunk(ids: list[int], kv: KVCache, T: int) -> tuple[np.ndarray, int, KVCache]:
    """The chunk of T rows (padded) that continues ids in kv: (tokens [T], real rows, kv). A chunk
    that would run past the cache's capacity starts earlier (kv.pos moved back), recomputing a few
    positions already written: an exact chunk gives every row the same bits wherever it starts."""
    pos = int(kv.pos)
    begin = max(min(pos, kv.capacity - T), 0)
    n = min(T, len(ids) - begin)
    chunk = np.zeros(T, np.int32)
    chunk[:n] = ids[begin:begin + n]
    return chunk, n, kv if begin == pos else kv.replace(pos=jnp.int32(begin))


def context_length(cfg: Config, ctx: int | None) -> int:
    """ctx (None: the model's max_position_embeddings), or JaxsmolError if the model cannot hold it."""
    ctx = cfg.max_position if ctx is None else int(ctx)
    if not 0 < ctx <= cfg.max_position:
        raise JaxsmolError(f"context length {ctx} must be in [1, {cfg.max_position}] "
                           "(the model's max_position_embeddings)")
    return ctx


def check_prompt(cfg: Config, ctx: int, ids, max_tokens: int = 0) -> list[int]:
    """Return ids as a list of ints, or raise JaxsmolError naming what is wrong with the request."""
    try:
        ids = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise JaxsmolError("token ids must be integers") from None
    if not ids:
        raise JaxsmolError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise JaxsmolError(f"token id {bad[0]} is outside [0, {cfg.vocab_size})")
    if max_tokens < 0:
        raise JaxsmolError(f"max_tokens must be >= 0, got {max_tokens}")
    if len(ids) + max_tokens > ctx:
        raise JaxsmolError(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                           f"context of {ctx} tokens")
    return ids


# The sources whose changes can change a state's bits (the forward, its kernels), with jax's version.
# relative to the jaxsmol package; only their bytes enter the hash, so a move keeps the identity
NUMERICS_SOURCES = ("model/forward.py", "model/rope.py", "model/kv.py", "kernels/cpu_matmul.cc",
                    "kernels/cpu_matmul_quant.cc", "kernels/cpu_matmul_int8.cc", "kernels/formats.py",
                    "kernels/cpu_attention.cc", "kernels/cpu_kernels.h", "kernels/cpu_matmul.h", "runtime/programs.py",
                    "runtime/batch.py")


@functools.cache
def numerics_identity() -> str:
    """A hash of the code that computes KV states: part of every engine's fingerprint."""
    import hashlib

    h = hashlib.blake2b(jax.__version__.encode(), digest_size=8)
    for name in NUMERICS_SOURCES:
        h.update((Path(__file__).parents[1] / name).read_bytes())
    return h.hexdigest()


class Engine:
    """A loaded model. Stateless between requests: every request gets its own immutable caches."""

    def __init__(self, cfg: Config, params: Params, tokenizer=None, ctx: int | None = None, model_dir=None,
                 mesh=None, source=None):
        """With `mesh` (sharding.make_mesh), params and caches are sharded over it; same forward.
        source: what was loaded (a GGUF file, or a directory), when not `model_dir` itself: it names the
        model (`name`)."""
        if cfg.quant and mesh is not None:
            raise JaxsmolError("quantized weights run on one device: no mesh")
        cfg = cpu_kernels.configure(cfg, params.embed.dtype, mesh)
        if cfg.matmul == "int8":
            with_matmul(cfg, "int8")  # a JaxsmolError where it cannot run
        # the weights' layout follows cfg (a no-op for params loaded with it; another engine's
        # params may come packed or not, their codes in either order)
        params = cpu_kernels.pack_params(params, packed=cfg.cpu_kernels)
        params = formats.params_for_dot(params, cfg.matmul)
        if mesh is not None:
            params = shard_params(params, mesh)
        self.cfg, self.params, self.tokenizer, self.mesh = cfg, params, tokenizer, mesh
        self.ctx = context_length(cfg, ctx)
        self.model_dir = Path(model_dir) if model_dir else None
        self.source = Path(source) if source else self.model_dir
        self._fingerprint = None
        self.staging = StagingBuffers()  # a restore's host buffers, kept between calls (buffers.py)
        self._arena: KVArena | None = None

    @classmethod
    def load(cls, model_dir: str | Path | None = None, *, ctx: int | None = None, dtype: str = "float32",
             quantize: str | None = None, kv_dtype: str | None = None, matmul: str = "auto", progress: bool = True,
             mesh=None, on_config: Callable | None = None) -> Engine:
        """Load a Hugging Face checkpoint directory, a GGUF file (its matrices as they are), or the bundled
        default model when None (its Q4_1 file as it is where the CPU kernels run, float32 elsewhere:
        checkpoint/default_model.py). quantize "q8_0" or "q4_1": every matrix quantized at load
        (kernels/formats.py), run as it is; "none": the float values (a GGUF's dequantized).
        kv_dtype "bfloat16" or "float32": the KV cache's dtype (default: the matrix products' input dtype).
        matmul (MATMULS, `with_matmul`): how quantized matrices multiply; "auto" is "int8" (x rounded
        to 8 bits per block, integer dots) under the CPU kernels, "exact" (the float32 bits) elsewhere.
        on_config(cfg, tokenizer), if given, runs before the weights are read (e.g. to start compiling).
        Compiled programs are kept on disk for the next process, unless JAX has a cache set (compile_cache.py)."""
        from jaxsmol.checkpoint.tokenizer import Tokenizer

        enable_compilation_cache(unless_set=True)

        float_weights = quantize == "none"  # the float values, a GGUF's dequantized
        quantize = None if float_weights else quantize
        if model_dir is None:
            from jaxsmol.checkpoint.default_model import default_model_source, runs_natively
            model_dir = default_model_source(not float_weights and runs_natively(dtype, quantize, mesh), progress)
        gguf, source = None, model_dir
        if Path(model_dir).is_file():  # a GGUF file: its matrices as they are (gguf_weights.py)
            gguf = GGUFFile(Path(model_dir), progress, requantize=quantize is not None or float_weights)
            model_dir, quantize = gguf.model_dir, quantize or gguf.format
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise JaxsmolError(f"model directory {model_dir} does not exist")
        if dtype not in ("float32", "bfloat16"):
            raise JaxsmolError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        if kv_dtype not in (None, "float32", "bfloat16"):
            raise JaxsmolError(f"kv_dtype must be float32 or bfloat16, got {kv_dtype!r}")
        cfg = dataclasses.replace(with_quantization(Config.load(model_dir), quantize, dtype, mesh), kv_dtype=kv_dtype)
        tokenizer = Tokenizer.load(model_dir)
        if tokenizer.eos_ids:
            cfg = dataclasses.replace(cfg, eos_ids=tuple(dict.fromkeys(cfg.eos_ids + tokenizer.eos_ids)))
        # before on_config, which may compile programs
        cfg = with_matmul(cpu_kernels.configure(cfg, dtype, mesh), matmul)
        if on_config is not None:
            on_config(cfg, tokenizer)
        if gguf is not None and gguf.format and cfg.quant == gguf.format:
            params = params_from_hf(cfg, gguf.tensors(cfg))
        else:
            params = load_params(model_dir, cfg, getattr(jnp, dtype))
        return cls(cfg, params, tokenizer, ctx=ctx, model_dir=model_dir, mesh=mesh, source=source)

    # ---- identity -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The model's name, as the daemon serves it (checkpoint/model_name.py)."""
        return model_name(self.source)

    @property
    def fingerprint(self) -> str:
        """A hash of config, dtype and every weight byte, of the code that computes the states, plus
        the device layout: caches keyed by it (snapshots on disk too) never mix models, nor states
        computed by another version of the forward or under different shardings (their last bits
        differ)."""
        if self._fingerprint is None:
            import hashlib

            h = hashlib.blake2b(repr(self.cfg).encode(), digest_size=16)
            h.update(numerics_identity().encode())
            if self.cfg.cpu_kernels:  # the kernels are loaded by now; an engine without them never builds them
                h.update(f"lanes={cpu_kernels.vector_lanes()}".encode())
            for leaf in jax.tree.leaves(self.params):
                h.update(str(leaf.dtype).encode() + str(leaf.shape).encode())
                h.update(np.asarray(leaf).tobytes())
            self._fingerprint = h.hexdigest() + ("" if self.mesh is None else "@" + describe(self.mesh))
        return self._fingerprint

    @property
    def cache_dtype(self):
        """The KV cache's dtype (Config.kv_dtype, else the matrix products' input dtype)."""
        return self.cfg.cache_dtype(self.params.compute_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one position over all layers (float32 SmolLM2-135M: 46,080)."""
        c = self.cfg
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.cache_dtype.itemsize

    # ---- validation -----------------------------------------------------------------------------
    def check_prompt(self, ids, max_tokens: int = 0) -> list[int]:
        """Return ids as a list of ints, or raise JaxsmolError naming what is wrong."""
        return check_prompt(self.cfg, self.ctx, ids, max_tokens)

    # ---- one sequence's cache: the pure API (the scheduler's rows live in the arena) ---------------
    @property
    def pool_bytes(self) -> int:
        """Bytes of the host buffers kept between requests: restores' staging (buffers.py, kv_arena.py)."""
        return self.staging.nbytes + (self._arena.staging_bytes if self._arena is not None else 0)

    def new_cache(self, slots: int) -> KVCache:
        """An empty one-sequence cache of the capacity that holds `slots` (the doubling ladder)."""
        return KVCache.zeros(self.cfg, capacity_for(slots), dtype=self.cache_dtype, mesh=self.mesh)

    def restore(self, snapshot: KVCache, slots: int, length: int | None = None) -> KVCache:
        """A device cache for `slots` slots holding the first `length` positions of a host snapshot.

        The snapshot is untouched; a host snapshot has no layout, so it is placed for this engine's
        mesh whatever layout computed it."""
        n = int(snapshot.pos) if length is None else length
        check_snapshot(snapshot, self.cfg, n)
        if n > capacity_for(slots):
            raise JaxsmolError(f"a prefix of {n} positions does not fit a cache of {slots} slots")
        kv = self.new_cache(slots)
        place = (lambda a: jax.device_put(a, may_alias=True)) if self.mesh is None else (
            lambda a: jax.device_put(a, kv_sharding(self.mesh, a.shape)))
        with self.staging.lock:  # one restore at a time uses the staging buffers
            k, v = self.staging.stage(snapshot.k, snapshot.v, n, ATTN_BLOCK)
            kernel = self.cfg.cpu_kernels and self.mesh is None  # the copy on both threads (not sharded)
            kv = programs.load_prefix(kv, place(k), place(v), jnp.int32(n), kernel=kernel)
            return jax.block_until_ready(kv)  # read before the next restore rewrites them

    def buckets(self, exact: bool = True) -> tuple[int, ...]:
        """The prefill chunk lengths this engine uses (see prefill_buckets)."""
        return prefill_buckets(exact, self.cfg.cpu_kernels)

    def chunk_rows(self, n_left: int, max_rows: int = PREFILL_BUCKETS[-1], exact: bool = True) -> int:
        """The padded length of the next chunk `prefill_chunk` runs with n_left tokens still to prefill."""
        return chunk_length(n_left, max_rows, self.buckets(exact))

    def slots_needed(self, start: int, n_prompt: int, max_tokens: int, exact: bool = True) -> int:
        """Cache slots a request touches: the padded prefill chunks and every decode position."""
        chunks_end = start + sum(chunk_plan(n_prompt - start, self.buckets(exact)))
        return max(chunks_end, n_prompt + max_tokens)

    def prefill(self, ids: list[int], kv: KVCache, exact: bool = True) -> tuple[jax.Array, KVCache]:
        """Feed ids[kv.pos:] into kv in bucketed chunks; return (logits [1, V] after ids[-1], kv).

        `kv` is donated. Requires kv.pos < len(ids) and enough capacity (see slots_needed).
        exact=False allows the short FAST_BUCKETS (not bit-identical to a cold prefill).
        """
        logits = None
        while logits is None or int(kv.pos) < len(ids):
            logits, kv = self.prefill_chunk(ids, kv, exact=exact)
        return logits, kv

    def prefill_chunk(self, ids: list[int], kv: KVCache, max_rows: int = PREFILL_BUCKETS[-1],
                      exact: bool = True) -> tuple[jax.Array, KVCache]:
        """Feed the next chunk of ids[kv.pos:] (at most max_rows real tokens) into kv (donated);
        returns (logits [1, V] after the chunk's last token, kv). (A chunk that would run past the
        capacity starts earlier: see _next_chunk.)"""
        T = self.chunk_rows(len(ids) - int(kv.pos), max_rows, exact)
        chunk, n, ready = _next_chunk(ids, kv, T)
        return programs.forward(self.params, jnp.asarray(chunk[None]), jnp.int32(n), ready, self.cfg)

    @property
    def side_by_side(self) -> bool:
        """Whether several prompts' chunks may share a forward (the arena's prefill) and keep the
        bits of a lone prefill: with the C++ kernels a row's bits do not depend on the rows beside
        it; XLA's fused attention may differ with the batch's shape, so without them, no."""
        return self.cfg.cpu_kernels

    def decode(self, token: int, kv: KVCache) -> tuple[jax.Array, KVCache]:
        """One token at kv.pos; `kv` is donated. Returns (logits [1, V], kv)."""
        return programs.forward(self.params, np.full((1, 1), token, np.int32), np.int32(1), kv, self.cfg)

    def warmup(self, tokens: int | None = None) -> int:
        """Compile every program a lone request of at most `tokens` prompt tokens (None: any) runs
        through a scheduler of the default settings (its prompt's chunks in a row of the arena, at most
        IDLE_STEP_ROWS rows a step, its first token's sampling, its decode step), so that later timings
        measure compute, not compilation: a 4-token probe needs the 8-row chunk's program, not the
        128-row one's. Compiled ahead of time (or loaded from the program store), not run. Returns how
        many programs."""
        from jaxsmol.runtime.arena_programs import ArenaShapes

        if self.mesh is not None:  # a mesh's programs take their layouts from the live arrays
            return 0
        most = IDLE_STEP_ROWS if tokens is None else min(tokens, IDLE_STEP_ROWS)  # a lone request's chunks
        lengths = {T for exact in (True, False) for T in self.buckets(exact)
                   if T <= chunk_length(most, buckets=self.buckets(exact))}
        a = ArenaShapes.of(self.arena())
        return programs.compile_all([a.prefill(1, T) for T in sorted(lengths)] + [a.first(1), a.decode(1)])

    def arena(self, rows: int = DEFAULT_ROWS) -> KVArena:
        """The KV arena the scheduler's rows live in (runtime/kv_arena.py), made on first use with
        DEFAULT_ROWS rows or `rows` if more, as many as fit the machine's memory (rows_that_fit), and
        made anew, larger, where a caller needs more rows than it has (the old one's users keep it;
        its memory goes with them)."""
        rows = rows_for(self.cfg, self.ctx, self.cache_dtype, rows, None if self.mesh else jax.devices()[0])
        if self._arena is None or self._arena.pad < rows:
            if self._arena is not None and self._arena.free_rows == self._arena.pad:
                self._arena = None  # unused: its memory goes before the new one is made
            self._arena = KVArena(self, rows)
        return self._arena

    @property
    def has_arena(self) -> bool:
        return self._arena is not None

    def logits_all(self, ids) -> np.ndarray:
        """[T, V] float32 logits of every position of ids (tests, parity): exact chunks of SCORE_ROWS
        rows in a row of the arena, so every row has the bits one forward over the whole gives."""
        ids = self.check_prompt(ids)
        arena = self.arena()
        out = np.empty((len(ids), self.cfg.vocab_size), np.float32)
        with arena.borrowed(len(ids)) as row:
            for begin, logits in arena.logits_chunks(row, ids, SCORE_ROWS):
                out[begin:begin + len(logits)] = logits
        return out
