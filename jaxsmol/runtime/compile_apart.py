"""Programs compiled in a child process into the program store, then loaded by the caller.

The command line keeps one malloc arena for all threads (system/host_memory.py: the daemon's big
buffers come from one heap that is kept, not faulted in afresh). XLA's compiler runs threads of its
own, and under one arena they wait on its lock: the daemon's programs compiled in 46.5 s there
against 31.3 s under glibc's default arenas (2 cores). So a process that keeps one arena, or any
process with many programs to compile, hands them to children started for the purpose, one per core:
each claims the next call no other has claimed (a file created exclusively), so a core that drew
larger programs takes fewer; it compiles its calls into the program store (program_store.py) and exits,
and its compiler's heap goes with it; the caller then loads each executable (~10 ms). A child gets the
calls' shapes alone (weights as ShapeDtypeStructs), pickled on its stdin; it is the same interpreter
with the same environment, so it computes the same store folder, or says it did not and the caller
compiles in process.

Processes sharing a store take turns (a lock file in its folder): replicas started together on one
machine compile each program once, and the others load it. Run as `python -m
jaxsmol.runtime.compile_apart` (by `compile_in_child` only).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import jax

from jaxsmol.runtime import program_store

MIN_CALLS = 6  # fewer than this many missing programs compile in process (a child costs ~2.5 s to start)
rounds = 0  # times this process had children compile (one round: a child per core)


def shapes_of(tree):
    """`tree` with every array leaf as its ShapeDtypeStruct (what a child needs to compile, not the values)."""
    def leaf(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
        return x
    return jax.tree.map(leaf, tree)


def compile_in_child(calls: list, stop: threading.Event | None = None, least: int = MIN_CALLS) -> int:
    """Compile `calls` ((program, args, kwargs) triples) into the program store in a child process,
    where at least `least` of them are missing there.
    Returns how many are stored then; 0 where it could not (no store, the child failed or computed
    another store folder, `stop` was set): the caller then compiles what is still missing itself.
    Processes sharing a store take turns (a lock file in its folder): replicas started together
    compile each program once, and the ones that waited load what the first stored."""
    folder = program_store.store_dir()
    if folder is None or not calls:
        return 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".compiling", "a")
    except OSError:  # a store that cannot be written: the caller compiles (and keeps) in process
        return 0
    with lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process compiles into this store: its turn first
                if stop is None:
                    time.sleep(0.2)
                elif stop.wait(0.2):
                    return 0
        try:
            still = [c for c in calls if c[0].missing(*c[1], **c[2])]
            if len(still) >= least and not _run_child(still, folder, stop):
                return 0
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return sum(1 for p, args, kwargs in calls if not p.missing(*args, **kwargs))


def _run_child(calls: list, folder, stop: threading.Event | None) -> bool:
    """Children compiling `calls` into `folder`, one per core the process may use (two cores: 35
    programs in ~2/3 of one child's time), each claiming calls until none is left; whether they all
    ran to their end."""
    global rounds
    rounds += 1
    n = max(1, min(len(os.sched_getaffinity(0)), len(calls) // MIN_CALLS))
    claims = tempfile.mkdtemp(prefix=".claims-", dir=folder)
    shapes = [(p.name, p.module, shapes_of(args), shapes_of(kwargs)) for p, args, kwargs in calls]
    payload = pickle.dumps({"root": str(program_store.root()), "folder": str(folder), "calls": shapes,
                            "claims": claims})
    started = []
    try:
        for _ in range(n):
            child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            done = threading.Thread(target=child.communicate, args=(payload,), daemon=True)
            done.start()
            started.append((child, done))
        while any(done.is_alive() for _, done in started):
            started[0][1].join(0.2)
            if stop is not None and stop.is_set():
                for child, done in started:
                    child.kill()
                    done.join()
                return False
        return all(child.returncode == 0 for child, _ in started)
    finally:
        shutil.rmtree(claims, ignore_errors=True)


def _claim(claims: str, index: int) -> bool:
    """Whether this child is the first to claim call `index` (the file's exclusive creation decides)."""
    try:
        os.close(os.open(os.path.join(claims, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _main() -> int:
    """The child: read the calls, compile each into the store; exit 3 where its store folder differs."""
    from pathlib import Path

    job = pickle.loads(sys.stdin.buffer.read())
    jax.config.update("jax_enable_compilation_cache", False)  # its executables could not be stored
    program_store.enable(Path(job["root"]))
    if str(program_store.store_dir()) != job["folder"]:
        print("jaxsmol: the compile child's environment differs from its parent's", file=sys.stderr)
        return 3
    for index, (name, module, args, kwargs) in enumerate(job["calls"]):
        if _claim(job["claims"], index):
            program_store.named(name, module).prepare(*args, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
