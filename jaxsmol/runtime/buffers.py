"""Engine.restore's host buffers, kept between calls because fresh memory of their size costs page faults.

`StagingBuffers`: two host buffers (keys, values), which a snapshot's prefix is copied through on its
way to the device (47 MB: ~60 ms fresh, ~7 ms reused), keys and values at once. Counted (`nbytes`, the
daemon's `jaxsmol_pool_bytes`), as large as the longest prefix restored.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxsmol.model.kv import aligned_host_prefix


class StagingBuffers:
    """Two host buffers (0: keys, 1: values), each grown to the largest restored prefix's k or v and
    kept. One restore at a time uses them: hold `lock` until the device has read them."""

    def __init__(self):
        self.raw = [np.empty(0, np.uint8)] * 2
        self.lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None  # copies the keys while the caller copies the values

    def stage(self, k: np.ndarray, v: np.ndarray, n: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n positions of host k and v, each in its buffer (kv.aligned_host_prefix), copied
        on two threads (NumPy lets go of the GIL while it copies): a 1008-position prefix of
        SmolLM2-135M, 2 x 24 MB, took 5.5-6 ms on one thread. Call with `lock` held."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="jaxsmol-staging")
        keys = self._helper.submit(aligned_host_prefix, k, n, multiple, lambda size: self.buffer(0, size))
        values = aligned_host_prefix(v, n, multiple, lambda size: self.buffer(1, size))
        return keys.result(), values

    def buffer(self, i: int, nbytes: int) -> np.ndarray:
        """Host buffer i of at least nbytes."""
        if self.raw[i].nbytes < nbytes:
            self.raw[i] = np.empty(nbytes, np.uint8)
        return self.raw[i]

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for raw in self.raw)
