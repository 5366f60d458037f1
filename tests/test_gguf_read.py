"""jaxsmol's GGUF reader (jaxsmol/checkpoint/gguf_read.py) against the `gguf` package's own reader:
the same metadata values and the same tensors, byte for byte; broken files refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxsmol.checkpoint.gguf_read import read_gguf
from jaxsmol.errors import JaxsmolError


def _same_as_gguf_reader(path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in ours.fields.items() if k != "nested"} == {k: v for k, v in want.items() if k != "nested"}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    lean = read_gguf(path, values=False)  # the tensors alone: the same views
    assert all(np.array_equal(a.data, b.data) for a, b in zip(lean.tensors, ours.tensors))


def test_every_value_type_and_tensor_type(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("u8", 7)
    w.add_int8("i8", -7)
    w.add_uint16("u16", 700)
    w.add_int16("i16", -700)
    w.add_uint32("u32", 70000)
    w.add_int32("i32", -70000)
    w.add_float32("f32", 0.25)
    w.add_uint64("u64", 1 << 40)
    w.add_int64("i64", -(1 << 40))
    w.add_float64("f64", 1e-300)
    w.add_bool("yes", True)
    w.add_string("text", "héllo ✓")
    w.add_array("ints", [1, 2, 3])
    w.add_array("words", ["a", "", "ü" * 40])
    w.add_array("flags", [True, False])
    w.add_array("nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.normal(size=(3, 32)).astype(np.float32))
    w.add_tensor("f16", rng.normal(size=(2, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path)
    fields = read_gguf(path).fields  # an array of arrays kept nested (gguf's contents() flattens it)
    assert fields["words"] == ["a", "", "ü" * 40] and fields["nested"] == [[1, 2], [3]]
    assert read_gguf(path, values=False).fields == {}


def test_the_tiny_model_file(tiny_gguf):
    _same_as_gguf_reader(tiny_gguf[0])


@pytest.mark.real
def test_the_bundled_file():
    from jaxsmol.checkpoint.default_model import bundled_gguf_path

    _same_as_gguf_reader(bundled_gguf_path())


def test_broken_files_are_refused_by_name(tiny_gguf, tmp_path):
    data = tiny_gguf[0].read_bytes()
    for name, content in {"junk.gguf": b"not a gguf file at all", "cut.gguf": data[:len(data) // 2],
                          "header.gguf": data[:40], "version.gguf": b"GGUF" + bytes([9, 0, 0, 0]) + data[8:]}.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(JaxsmolError, match=f"cannot read GGUF file .*{name}"):
            read_gguf(path)
