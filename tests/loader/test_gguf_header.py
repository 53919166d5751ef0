"""The GGUF header reader against the `gguf` package's own reader, on a file written by its writer with
every value type, and the chunked dequantization against `gguf.quants.dequantize`."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from morion.errors import ModelLoadError
from morion.loader import gguf_loader
from morion.loader.gguf_header import GGUFTensor, read_gguf_header
from morion.loader.gguf_loader import read_gguf


def _write(path, tensors: dict[str, np.ndarray], raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]]):
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["a", "", "ünï", "<|im_end|>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (array, kind) in raw.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def sample(tmp_path):
    rng = np.random.default_rng(0)
    quantized = gguf.quants.quantize(
        rng.standard_normal((40, 64)).astype(np.float32), GGMLQuantizationType.Q4_1
    )
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4, 8)).astype(np.float16),
    }
    path = tmp_path / "sample.gguf"
    _write(path, tensors, {"q4_1": (quantized, GGMLQuantizationType.Q4_1)})
    return path


def test_header_equals_the_gguf_readers(sample):
    ours = read_gguf_header(sample)
    reader = GGUFReader(sample)
    theirs = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == theirs
    assert ours.metadata["t.str"] == "héllo ✓" and ours.metadata["t.strings"][2] == "ünï"
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, their in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == their.tensor_type
        assert mine.shape == tuple(int(d) for d in their.shape)
        assert mine.data.shape == their.data.shape and np.array_equal(mine.data, np.asarray(their.data))


def test_dequantized_in_chunks_equals_gguf(sample, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_DEQUANTIZE_CHUNK_ELEMENTS", 64 * 3)  # 3 rows per call: 14 calls
    for tensor in read_gguf_header(sample).tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        expected = expected.reshape(tuple(reversed(tensor.shape))).astype(np.float32)
        got = gguf_loader._dequantize(tensor)
        assert got.dtype == np.float32 and got.flags.writeable and got.flags.c_contiguous
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("cut", [3, 40, 300])
def test_truncated_or_foreign_files_are_not_a_gguf(sample, tmp_path, cut):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(sample.read_bytes()[:cut])
    with pytest.raises(ModelLoadError, match="is not a valid GGUF file"):
        read_gguf(broken)


def test_big_endian_files_are_named(tmp_path):
    path = tmp_path / "big.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ModelLoadError, match="big-endian GGUF files are not supported"):
        read_gguf(path)


def test_tensor_views_are_of_the_file(sample):
    [tensor] = [t for t in read_gguf_header(sample).tensors if t.name == "f32"]
    assert isinstance(tensor, GGUFTensor) and not tensor.data.flags.writeable
