"""The quantized-weights cache (sharding/quant_cache.py): a start under --quantization writes each rank's quantized
linears, the next start reads them instead of the checkpoint's weights and answers exactly as before; a changed
checkpoint is a miss, a damaged file is rebuilt (never served), and --no-quantized-cache reads and writes nothing.

Every test has its own cache folder through TPSERVE_QUANTIZED_CACHE (not a fresh TPSERVE_HOME: that also holds the
compiled kernels, which every rank would then compile again). TP 1 runs in this process (LLM at TP 1 starts no other
process); TP 2 and two servers at once run through tests/helpers/run_llm.py.
"""

from __future__ import annotations

import json
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from llm_runner import run_llm
from loaders import envs
from loaders.checkpoint import Checkpoint, read_safetensors_header
from sharding.layers import quant
from tiny import make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(30, 50))]
MAX_TOKENS = 8


def checkpoint(folder: Path, seed: int = 0) -> Path:
    """A tied LM head (quantized after the loop, from the embedding) and biases on every linear (kept in the file):
    at TP 2 every shard's input size is still a multiple of 32, so every linear is quantized."""
    return make_checkpoint(folder, "llama_tied", seed=seed, intermediate_size=128, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("quant_cache"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "quantized"
    monkeypatch.setenv(envs.QUANTIZED_CACHE.name, str(folder))
    return folder


def start(folder: Path, **llm) -> dict:
    """One in-process start at TP 1 (-q int4 unless told): greedy tokens with their logprobs, the checkpoint bytes
    the rank read, and the start's phases."""
    from server.engine.sampler import SamplingParams
    from server.llm import LLM

    llm = LLM(str(folder), max_num_seqs=2, kv_cache_memory=8 << 20, **{"quantization": "int4", **llm})
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
        outs = llm.generate(PROMPTS, params)
        return {"answers": [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs],
                "bytes_read": llm.executor.bytes_read, "phases": dict(llm.executor.phases.seconds)}
    finally:
        llm.close()


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*.safetensors"))


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "sharding.quant_cache" and r.levelno >= logging.WARNING]


def not_linear_bytes(folder: Path) -> int:
    """The checkpoint's bytes that are not a linear's (embedding, norms): all a start that hits has to read."""
    with Checkpoint(folder) as ckpt:
        return sum(info.nbytes for name, info in ckpt.tensors.items() if "_proj." not in name)


@pytest.mark.parametrize("mode", quant.MODES)
def test_a_weight_as_tensors_and_back(mode):
    """quant.to_tensors / from_tensors: the same bytes and fields back, bound to the kernel; tensors that are not what
    the fields say are refused."""
    qw = quant.quantize(torch.randn(40, 256), mode, 32)
    tensors, fields = quant.to_tensors(qw)
    back = quant.from_tensors(dict(tensors), json.loads(json.dumps(fields)))
    assert (back.mode, back.in_features, back.out_features, back.group, back.rows) == (
        qw.mode, qw.in_features, qw.out_features, qw.group, qw.rows)
    assert torch.equal(back.data, qw.data) and torch.equal(back.scale, qw.scale)
    assert (back.kernel is None) == (qw.kernel is None)
    x = torch.randn(3, 256)
    assert torch.equal(quant.linear(x, back), quant.linear(x, qw))
    with pytest.raises(ValueError, match="data is"):
        quant.from_tensors(dict(tensors, data=tensors["data"][:-1]), fields)
    with pytest.raises(ValueError, match="not the fields"):
        quant.from_tensors(tensors, dict(fields, rows=3))


def test_a_miss_writes_the_cache_and_the_next_start_reads_it(model, cache, caplog):
    caplog.set_level(logging.INFO, logger="sharding.quant_cache")
    first = start(model)
    [file] = entries(cache)
    assert file.name == "rank-0-of-1-stage-0.safetensors" and file.parent.name.startswith(model.name + "-")
    # 4 per layer (q/k/v and gate/up are fused) and the LM head
    assert "wrote 9 quantized linears" in caplog.text and str(file) in caplog.text
    assert "writing the quantized cache" in first["phases"]
    # a safetensors file as any reader reads it, its metadata the key and every linear's fields and checksums
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
        assert json.loads(meta["key"])["mode"] == "int4" and len(json.loads(meta["modules"])) == 9
        assert f.get_tensor("lm_head.data").dtype == torch.int8  # the tied head, in int8
    caplog.clear()
    second = start(model)
    assert "read 9 quantized linears" in caplog.text and "writing the quantized cache" not in second["phases"]
    assert second["answers"] == first["answers"]
    assert second["bytes_read"] == not_linear_bytes(model) < first["bytes_read"] / 2
    assert entries(cache) == [file]


def test_a_changed_checkpoint_is_a_new_entry(tmp_path, cache):
    folder = checkpoint(tmp_path / "model")
    old = start(folder)
    checkpoint(folder, seed=1)  # the same names and shapes, other weights
    new = start(folder)
    assert len(entries(cache)) == 2  # a miss: written beside the first
    assert new["answers"] == start(folder, quantized_cache=False)["answers"] != old["answers"]


def damage(file: Path, how: str) -> None:
    """Damage the cache file as a crash, a disk or a bug could."""
    if how == "truncated":
        with open(file, "r+b") as f:
            f.truncate(file.stat().st_size - 100)
    elif how == "flipped":  # bytes in the middle of a quantized weight
        info = read_safetensors_header(file)["layers.1.mlp.down_proj.data"]
        with open(file, "r+b") as f:
            f.seek(info.offset + info.nbytes // 2)
            b = f.read(4)
            f.seek(info.offset + info.nbytes // 2)
            f.write(bytes(x ^ 0xFF for x in b))
    else:  # a linear missing, or one of another shape: the file otherwise consistent, its checksums included
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(file), "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        modules = json.loads(meta["modules"])
        name = "layers.0.self_attn.o_proj"  # [64, 64] with its bias
        tensors = {k: v for k, v in tensors.items() if not k.startswith(name + ".")}
        if how == "missing":
            del modules[name]
        else:  # a [32, 64] weight and bias in its place
            parts, fields = quant.to_tensors(quant.quantize(torch.randn(32, 64), "int4", 32))
            parts["bias"] = torch.zeros(32)
            modules[name] = dict(fields, crc32={t: zlib.crc32(v.reshape(-1).view(torch.uint8).numpy())
                                                for t, v in parts.items()})
            tensors.update((f"{name}.{t}", v) for t, v in parts.items())
        save_file(tensors, str(file), dict(meta, modules=json.dumps(modules)))


@pytest.mark.parametrize("how", [pytest.param("truncated", marks=pytest.mark.slow), "flipped",
                                 pytest.param("missing", marks=pytest.mark.slow),
                                 pytest.param("reshaped", marks=pytest.mark.slow)])
def test_a_damaged_cache_is_rebuilt_not_served(model, cache, caplog, how):
    first = start(model)
    [file] = entries(cache)
    damage(file, how)
    caplog.clear()
    rebuilt = start(model)
    [warning] = cache_warnings(caplog)
    assert str(file) in warning and "damaged" in warning
    assert rebuilt["answers"] == first["answers"] and rebuilt["bytes_read"] == first["bytes_read"]
    caplog.clear()
    again = start(model)  # written again, whole
    assert not cache_warnings(caplog)
    assert again["answers"] == first["answers"] and again["bytes_read"] == not_linear_bytes(model)


def test_no_quantized_cache_reads_and_writes_nothing(model, cache):
    off = start(model, quantized_cache=False)
    assert not cache.exists()
    on = start(model)  # writes
    assert start(model, quantized_cache=False)["bytes_read"] == off["bytes_read"] == on["bytes_read"]
    assert len(entries(cache)) == 1


def test_the_flag_reaches_every_rank(model):
    from server.cli.main import build_parser, engine_config
    from sharding.runner import EngineConfig

    for flags, on in (([], True), (["--no-quantized-cache"], False)):
        for cmd in ("serve", "generate"):
            cfg = engine_config(build_parser().parse_args([cmd, str(model), "-q", "int4", *flags]))
            assert cfg.quantized_cache is on
            assert EngineConfig.from_argv(cfg.to_argv()).quantized_cache is on  # the worker's command line


@pytest.mark.slow
def test_tp2_writes_a_file_per_rank(model, cache):
    """TP 2 in one process: a start without the cache, then a miss that writes one file per rank, then a hit, all
    with the same answers."""
    job = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 3,
           "max_num_seqs": 2, "llm": {"quantization": "int4", "kv_cache_memory": 8 << 20}}
    off = dict(job, llm=dict(job["llm"], quantized_cache=False))
    off_out, miss, hit = run_llm(2, [off, job, job], timeout=240, env={envs.QUANTIZED_CACHE.name: str(cache)})
    for r in (off_out, miss, hit):
        assert "error" not in r, r
    assert [p.name for p in entries(cache)] == ["rank-0-of-2-stage-0.safetensors", "rank-1-of-2-stage-0.safetensors"]
    assert hit["outputs"] == miss["outputs"] == off_out["outputs"]
    assert hit["bytes_read"] < miss["bytes_read"] / 2 and miss["bytes_read"] == off_out["bytes_read"]


def test_two_starts_at_once_share_it(model, cache, caplog):
    """Two servers starting at once on one checkpoint (TP 1, each in its process): both serve, and the file the last
    one renamed into place is whole."""
    job = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 3,
           "max_num_seqs": 2, "llm": {"quantization": "int4", "kv_cache_memory": 8 << 20}}
    env = {envs.QUANTIZED_CACHE.name: str(cache)}
    with ThreadPoolExecutor(2) as pool:
        both = [pool.submit(run_llm, 1, [job], timeout=240, env=env) for _ in range(2)]
        (a,), (b,) = (f.result() for f in both)
    for r in (a, b):
        assert "error" not in r, r
    assert a["outputs"] == b["outputs"]
    [file] = entries(cache)
    assert not list(file.parent.glob(".*"))  # no temporary file left behind
    after = start(model)  # reads it, whole
    assert after["bytes_read"] == not_linear_bytes(model) and not cache_warnings(caplog)
    assert [o["token_ids"] for o in a["outputs"]] == [t for t, _, _ in after["answers"]]


def test_a_16_bit_lm_head_is_quantized_from_its_stored_rows(tmp_path):
    """An untied bfloat16 LM head under -q int8 is read as stored and quantized chunk by chunk from it
    (ParallelLMHead.read_as_stored): never a whole float32 copy (Llama-3-8B's would be 2.1 GB at load), and the same
    bytes as quantizing the float32 rows."""
    from safetensors import safe_open

    from server.llm import LLM

    folder = make_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16, intermediate_size=128)
    llm = LLM(str(folder), max_num_seqs=2, kv_cache_memory=8 << 20, quantization="int8", quantized_cache=False)
    try:
        head = llm.executor.model.lm_head
        assert head.read_as_stored and head.weight is None
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            want = quant.quantize(f.get_tensor("lm_head.weight").float(), "int8")
        assert torch.equal(head.qweight.data, want.data) and torch.equal(head.qweight.scale, want.scale)
    finally:
        llm.close()
