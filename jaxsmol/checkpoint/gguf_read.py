"""A GGUF file read: its metadata as Python values and its tensors as memory-mapped arrays.

`gguf.GGUFReader` builds a NumPy view for every part of every metadata value, ~150k of them for a
tokenizer's vocabulary and merges: 3.5 s for the bundled 98 MB file, most of a cold start. `read_gguf`
decodes the values straight from the mapped bytes (a numeric array with one `frombuffer`, a string
array as a run of length-prefixed strings): 0.15 s. `values=False` steps over them, for what needs the
tensors only (running a file whose config and tokenizer are imported already). Each `Tensor.data` is
the view gguf's reader gives (a float type's elements, or a quantized type's rows of bytes).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np

from jaxsmol.errors import JaxsmolError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUFValueType
_ALIGNMENT_KEY = "general.alignment"
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of the file, with the attributes of gguf's ReaderTensor that jaxsmol reads."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, fastest first (GGUF's order)
    data: np.ndarray  # memory-mapped: elements [slowest .. fastest], or a quantized type's bytes per row


@dataclasses.dataclass(frozen=True)
class GGUFContents:
    fields: dict  # key -> str, int, float, bool or a list of them (empty with values=False, but the alignment)
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8")

    def value(self, kind: int, keep: bool):
        """The value of type `kind` here (None where not `keep`: stepped over)."""
        if kind == _STRING:
            return self.string() if keep else self.skip_string()
        if kind == _ARRAY:
            inner, n = self.take("IQ")
            if inner in _SCALARS:  # one read for the whole array
                size = struct.calcsize(_SCALARS[inner])
                self.at += n * size
                if not keep:
                    return None
                raw = np.frombuffer(self.buf[self.at - n * size:self.at], "<" + _SCALARS[inner])
                return raw.astype(bool).tolist() if inner == 7 else raw.tolist()
            items = [self.value(inner, keep) for _ in range(n)]
            return items if keep else None
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        v = self.take(_SCALARS[kind])
        return v if keep else None

    def skip_string(self) -> None:
        n = self.take("Q")  # a length, then that many bytes
        self.at += n


def read_gguf(path: Path, values: bool = True) -> GGUFContents:
    """The GGUF file at `path` (values=False: its metadata's values stepped over); a JaxsmolError naming
    the file for what is not one."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        data = np.memmap(path, mode="r")
        cur = _Cursor(memoryview(data))
        if bytes(data[:4]) != _MAGIC:
            raise ValueError("no GGUF magic")
        cur.at = 4
        version, n_tensors, n_fields = cur.take("IQQ")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version}, not one of {_VERSIONS}")
        fields = {}
        for _ in range(n_fields):
            key, kind = cur.string(), cur.take("I")
            keep = values or key == _ALIGNMENT_KEY
            v = cur.value(kind, keep)
            if keep:
                fields[key] = v
        alignment = fields.get(_ALIGNMENT_KEY, 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{_ALIGNMENT_KEY} must be a power of two, got {alignment!r}")
        infos, seen = [], set()
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.take("I")
            if name in seen:
                raise ValueError(f"tensor {name} appears twice")
            seen.add(name)
            dims = np.array(cur.take(f"{n_dims}Q"), np.uint64).reshape(n_dims)
            kind, offset = cur.take("IQ")
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        start = -(-cur.at // alignment) * alignment
        tensors = []
        for name, dims, kind, offset in infos:
            shape = tuple(int(d) for d in reversed(dims))  # slowest first
            block, type_bytes = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(shape)) * type_bytes // block
            raw = data[start + offset:start + offset + n_bytes]
            if len(raw) != n_bytes:
                raise ValueError(f"tensor {name} runs past the end of the file")
            element = _ELEMENT_DTYPES.get(kind.name)
            if element is not None:
                view = raw.view(element).reshape(shape)
            else:  # rows of blocks' bytes, as gguf's quant_shape_to_byte_shape
                view = raw.reshape(*shape[:-1], shape[-1] // block * type_bytes)
            tensors.append(Tensor(name, kind, dims, view))
    except (ValueError, struct.error, OSError, UnicodeDecodeError) as e:
        raise JaxsmolError(f"cannot read GGUF file {path}: {e}") from None
    return GGUFContents(fields, tensors)
