"""Programs compiled ahead, kept on disk as XLA executables and loaded back without tracing.

A later process finds a program in JAX's persistent compilation cache only after tracing and
lowering it again to compute the cache key: ~65 ms a program, 4.5 of a daemon's 6 s of warm-up on a
second start. A `Program` (one jitted function, see programs.py) keeps the executables compiled ahead
(`prepare`) by their call signature, the static arguments' values and the other arguments' pytree
and avals, and a call with that signature runs its executable at once; any other call runs the
jitted function as before. `prepare` reads the executable from `<compile cache>/programs/` (loading
one: ~10 ms) or compiles it and writes it there (`jax.experimental.serialize_executable`).

Every call of a Program goes through its prepared executables: a signature met for the first time
is prepared then (compiled, or loaded where a stored one exists), so a later process loads it too.

A file is read only by the environment that wrote it: its folder is named by a hash of the jax and
jaxlib versions, the backend and devices, the CPU, the C++ kernels' build, XLA_FLAGS and every source
file of jaxsmol, and the JAX settings in CONFIG; anything unreadable or of another environment is
refused (compiled afresh). The store takes the place of JAX's persistent cache
(compile_cache.enable_compilation_cache switches that off): an executable JAX loaded from its cache,
or found in its in-memory cache after such a load, serializes without its machine code, and a later
load of it fails when it runs. So nothing is stored while JAX's cache is in use.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import pickle
import platform
import threading
import weakref
from pathlib import Path

import jax
from jax.sharding import SingleDeviceSharding

from jaxsmol.system import program_memory

FORMAT = 1
# JAX settings a program's code depends on beyond its signature; a process may set them in code (a
# compile child started from it sees only the environment, so it computes another folder: refused)
CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable", "jax_default_prng_impl")
_root: Path | None = None  # the store's directory (enable), None: executables are kept in memory only
_defined: dict = {}  # every Program by name


class Program:
    """A jitted function plus the executables prepared for some of its call signatures."""

    def __init__(self, name: str, jitted, static: tuple[str, ...] = (), module: str | None = None):
        """`module`: where this Program is defined, so another process can import it by name (named)."""
        self.name, self.jitted, self.static, self.module = name, jitted, static, module
        _defined[name] = self
        parameters = inspect.signature(jitted).parameters
        self._names = tuple(parameters)
        self._defaults = {k: p.default for k, p in parameters.items() if p.default is not inspect.Parameter.empty}
        self._ready: dict = {}  # signature key -> a Compiled
        self._refused: set = set()  # signature keys whose calls an executable refused (run by jit instead)
        self._memo: dict = {}  # id of a large argument (the weights) -> (a weak reference to it, its key part)
        self.prepared = 0  # executables made ready (compiled or loaded)
        self.loaded = 0  # of which read from the store

    def _split(self, args, kwargs):
        """(static values, dynamic arguments in signature order): the form every executable is called in."""
        if len(args) > len(self._names):
            raise TypeError(f"{self.name} takes {len(self._names)} arguments, got {len(args)}")
        bound = {**self._defaults, **dict(zip(self._names, args)), **kwargs}
        missing = [k for k in self._names if k not in bound]
        if missing or len(bound) != len(self._names):
            raise TypeError(f"{self.name}: missing or unknown arguments ({', '.join(missing) or sorted(kwargs)})")
        return (tuple((k, bound[k]) for k in self.static),
                tuple(bound[k] for k in self._names if k not in self.static))

    def _key(self, static, dynamic):
        """static values, then per dynamic argument its pytree and each leaf's (shape, dtype, weak type,
        sharding over several devices or None): what picks an executable, for arrays and
        ShapeDtypeStructs alike. A large argument's part is remembered by identity (the weights are the
        same object call after call: flattening them each time was most of a call's cost)."""
        parts = []
        for value in dynamic:
            memo = self._memo.get(id(value))
            if memo is not None and memo[0]() is value:
                parts.append(memo[1])
                continue
            leaves, tree = jax.tree.flatten(value)
            part = (tree, tuple(_aval(x) for x in leaves))
            if len(leaves) > 8:
                try:
                    ref = weakref.ref(value)
                except TypeError:  # not weakly referenceable: not remembered
                    ref = None
                if ref is not None:
                    if len(self._memo) >= 8:  # a new dict, not a pop: another thread may be reading this one
                        self._memo = {}
                    self._memo[id(value)] = (ref, part)
            parts.append(part)
        return static, tuple(parts)

    def __call__(self, *args, **kwargs):
        static, dynamic = self._split(args, kwargs)
        key = self._key(static, dynamic)
        compiled = self._ready.get(key) or self._prepare(key, static, dynamic)
        try:
            return compiled(*dynamic)
        except (TypeError, ValueError):  # refused before running (an argument's layout): traced by jit instead
            self._refused.add(key)
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    @property
    def held(self) -> int:
        """Executables this program holds: prepared, and any jit compiled for a call they refused."""
        return len(self._ready) + len(self._refused)

    def clear(self) -> None:
        """Forget every executable held (the store keeps its files): the next calls prepare them again."""
        self._ready.clear()
        self._refused.clear()
        self.jitted.clear_cache()

    def prepare(self, *args, **kwargs) -> None:
        """Make the executable of this call ready (arguments may be ShapeDtypeStructs): loaded from the
        store where it is there, else compiled (and written there where a store is set)."""
        static, dynamic = self._split(args, kwargs)
        key = self._key(static, dynamic)
        if key not in self._ready:
            self._prepare(key, static, dynamic)

    def ready(self, *args, **kwargs) -> bool:
        """Whether the executable of this call is held in memory (a call runs it at once)."""
        return self._key(*self._split(args, kwargs)) in self._ready

    def missing(self, *args, **kwargs) -> bool:
        """Whether the executable of this call is neither held in memory nor in the store, and could be
        stored (a store is set, and the arguments live on one device)."""
        key = self._key(*self._split(args, kwargs))
        path = self._path(key)
        return key not in self._ready and path is not None and not path.is_file()

    def _path(self, key) -> Path | None:
        """Where the store keeps the executable of `key`; None without a store, or for arguments
        spread over several devices (their executables are not stored)."""
        directory = store_dir()
        persist = directory is not None and all(a[-1] is None for _, avals in key[1] for a in avals)
        return directory / f"{self.name}-{_digest(repr(key))}.xla" if persist else None

    def _prepare(self, key, static, dynamic):
        path = self._path(key)
        with program_memory.loading():
            compiled = _load(path) if path is not None else None
        if compiled is None:
            compiled = self.jitted.lower(*dynamic, **dict(static)).compile()
            if path is not None:
                _write(path, compiled)
        else:
            self.loaded += 1
        self._ready[key] = compiled
        self.prepared += 1
        return compiled


def _aval(x) -> tuple:
    if isinstance(x, jax.Array):
        shape, dtype, weak, sharding = x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding
    elif isinstance(x, jax.ShapeDtypeStruct):
        shape, dtype, weak, sharding = x.shape, x.dtype, x.weak_type, x.sharding
    else:  # NumPy arrays and scalars, Python numbers
        a = jax.typeof(x)
        shape, dtype, weak, sharding = a.shape, a.dtype, a.weak_type, None
    several = sharding is not None and not isinstance(sharding, SingleDeviceSharding)
    return tuple(shape), dtype, weak, sharding if several else None


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def enable(root: Path | None) -> None:
    """Keep executables under `root` (None: in memory only), from now on in this process."""
    global _root
    _root = root


def named(name: str, module: str) -> Program:
    """The Program `name`, defined on importing `module` (a compile child finds it so: compile_apart.py)."""
    importlib.import_module(module)
    return _defined[name]


def root() -> Path | None:
    """The enabled root (enable), None for none."""
    return _root


def store_dir() -> Path | None:
    """Where executables are kept: `programs/` under the enabled root, in a folder named by the
    environment's hash; None where none is enabled, or where JAX's persistent cache is in use (its
    executables could not be stored: see the module docstring)."""
    if _root is None or jax.config.jax_compilation_cache_dir is not None:
        return None
    return _root / "programs" / environment()


@functools.cache
def environment() -> str:
    """A hash of what a stored executable depends on besides its own signature."""
    import jaxlib

    from jaxsmol.kernels import cpu_kernels

    kernels = cpu_kernels.state()
    package = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=10)
    for part in (str(FORMAT), jax.__version__, jaxlib.__version__, platform.machine(), jax.default_backend(),
                 repr(sorted(d.device_kind for d in jax.devices())), cpu_kernels.cpu_signature(),
                 str(kernels.library if kernels.in_use else "off"), os.environ.get("XLA_FLAGS", ""),
                 *(repr(getattr(jax.config, k)) for k in CONFIG)):
        h.update(part.encode() + b"\0")
    for source in sorted(package.rglob("*.py")):
        h.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    return h.hexdigest()


def _load(path: Path):
    """The executable stored at `path`, or None (missing, unreadable, or not this environment's)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        with open(path, "rb") as f:
            stored = pickle.load(f)
        if stored.get("format") != FORMAT or stored.get("environment") != environment():
            return None
        # only single-device programs are stored (see _path), compiled for the default device; left
        # unsaid, a process with several devices loads one onto all of them and every call fails
        return deserialize_and_load(stored["payload"], stored["in_tree"], stored["out_tree"],
                                    execution_devices=jax.devices()[:1])
    except FileNotFoundError:
        return None
    except Exception:  # a truncated or foreign file: compiled afresh (and rewritten)
        return None


def _write(path: Path, compiled) -> None:
    """Store `compiled` at `path` (atomically: a crash leaves no half file); a failure only loses the
    head start of the next process."""
    from jax.experimental.serialize_executable import serialize

    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        payload, in_tree, out_tree = serialize(compiled)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump({"format": FORMAT, "environment": environment(), "payload": payload,
                         "in_tree": in_tree, "out_tree": out_tree}, f)
        os.replace(tmp, path)
    except Exception:
        tmp.unlink(missing_ok=True)  # no half file left behind either
