import json

import pytest
import torch
from safetensors.torch import save_file

from loaders.checkpoint import Checkpoint, CheckpointError


@pytest.fixture()
def folder(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(12, 10),
        "b": torch.randn(5, 6, 7).to(torch.bfloat16),
        "bias": torch.randn(12),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}))
    return tmp_path, tensors


def test_row_and_column_blocks_equal_slices_and_count_only_their_bytes(folder):
    path, ref = folder
    with Checkpoint(path) as ck:
        assert torch.equal(ck.read("a", 0, [(3, 7)]), ref["a"][3:7])
        assert ck.bytes_read == 4 * 10 * 4
        got = ck.read("a", 1, [(2, 5), (8, 10)])
        assert got.is_contiguous()
        assert torch.equal(got, torch.cat([ref["a"][:, 2:5], ref["a"][:, 8:10]], 1))
        assert ck.bytes_read == 4 * 10 * 4 + 12 * 5 * 4
        assert torch.equal(ck.read("b", 1, [(1, 4)]), ref["b"][:, 1:4])
        assert torch.equal(ck.read("b"), ref["b"])
        assert torch.equal(ck.read("bias", 0, [(0, 6)]), ref["bias"][:6])
        assert ck.resolve_dtype("auto") == torch.bfloat16


def test_sharded_index_maps_names_to_files(tmp_path):
    t1, t2 = {"x": torch.arange(6.0).view(2, 3)}, {"y": torch.ones(4)}
    save_file(t1, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(t2, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    with Checkpoint(tmp_path) as ck:
        assert ck.tensors["y"].path.name == "model-00002-of-00002.safetensors"
        assert torch.equal(ck.read("x", 1, [(1, 3)]), t1["x"][:, 1:3])


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="safetensors only"):
        Checkpoint(tmp_path)


def test_truncated_file_is_reported(folder):
    path, _ = folder
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="inconsistent offsets"):
        Checkpoint(path)


def test_block_outside_tensor(folder):
    with Checkpoint(folder[0]) as ck, pytest.raises(CheckpointError, match="outside"):
        ck.read("a", 0, [(10, 13)])


def test_a_header_is_bounded_before_anything_is_computed_from_it(tmp_path):
    """Shapes of many dimensions, or of huge ones (JSON integers of up to 4300 digits), are refused before their
    product is taken (100 dimensions of 4000 digits: 0.4 s of math.prod holding the GIL; 1000: 43 s), and a message
    quotes neither those numbers nor the header length field."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    huge = int("9" * 4000)

    def write(header: dict | bytes, length: int | None = None, data: bytes = bytes(16)) -> None:
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        (tmp_path / "model.safetensors").write_bytes((len(raw) if length is None else length).to_bytes(8, "little")
                                                     + raw + data)

    cases = [
        ({"a": {"dtype": "F32", "shape": [huge] * 100, "data_offsets": [0, 16]}}, None, "at most 8 non-negative"),
        ({"a": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}, None, "at most 8 non-negative"),
        ({"a": {"dtype": "F32", "shape": [huge, 1], "data_offsets": [0, 16]}}, None, "dimension above"),
        ({"a": {"dtype": "F32", "shape": [2**41, 0], "data_offsets": [0, 0]}}, None, "dimension above"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, huge]}}, None, "inconsistent offsets"),
        (b"{}", 123456789, "the header length field is not valid"),
        (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}", None, "integer too long"),
        ({"x" * 10_000: {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, None, "inconsistent offsets"),
    ]
    for header, length, match in cases:
        write(header, length)
        with pytest.raises(CheckpointError, match=match) as e:
            Checkpoint(tmp_path)
        message = str(e.value)
        assert "9999" not in message and "123456789" not in message and len(message) < 400, message
