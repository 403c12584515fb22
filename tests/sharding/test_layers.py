"""Each parallel layer, run on 2 and 3 real ranks over gloo, equals the dense torch layer it replaces."""

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import save_file

from loaders.checkpoint import Checkpoint
from loaders.partition import split_evenly
from sharding.dist import init_dist
from sharding.layers.linear import ColumnParallelLinear, ParallelLMHead, Piece, RowParallelLinear, VocabParallelEmbedding

IN, OUT, VOCAB = 24, 30, 101  # 101: no world size divides it


def weights():
    g = torch.Generator().manual_seed(0)
    return {
        "q.weight": torch.randn(OUT, IN, generator=g), "q.bias": torch.randn(OUT, generator=g),
        "k.weight": torch.randn(12, IN, generator=g),
        "o.weight": torch.randn(IN, OUT, generator=g), "o.bias": torch.randn(IN, generator=g),
        "emb.weight": torch.randn(VOCAB, IN, generator=g), "head.weight": torch.randn(VOCAB, IN, generator=g),
    }


def rank_main(rank, world, port, folder, queue):
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          TPSERVE_STORE_PORT=str(port), TPSERVE_STORE_SECRET="hand-made-ranks-" + str(port),
                          TPSERVE_THREADS="1", TPSERVE_COLLECTIVE_TIMEOUT="60")
        d = init_dist()
        w = weights()
        cpu = torch.device("cpu")
        x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
        ck = Checkpoint(folder)
        # column-parallel, fused from two tensors, with bias on the first only
        a, b = split_evenly(OUT, world, rank)
        c, e = split_evenly(12, world, rank)
        col = ColumnParallelLinear(IN, [Piece("q", a, b, (OUT, IN))], True, torch.float32, cpu)
        col.load(ck)
        fused = ColumnParallelLinear(IN, [Piece("q", a, b, (OUT, IN)), Piece("k", c, e, (12, IN))], False,
                                     torch.float32, cpu)
        fused.load(ck)
        col_ok = torch.allclose(col(x), F.linear(x, w["q.weight"][a:b], w["q.bias"][a:b]), atol=1e-6)
        fused_ok = torch.allclose(fused(x), torch.cat([x @ w["q.weight"][a:b].T, x @ w["k.weight"][c:e].T], 1),
                                  atol=1e-6)
        # row-parallel: the input is this rank's column block of the column-parallel output
        row = RowParallelLinear(Piece("o", a, b, (IN, OUT)), True, d, torch.float32, cpu)
        row.load(ck)
        h = F.linear(x, w["q.weight"], w["q.bias"])
        row_ok = torch.allclose(row(h[:, a:b]), F.linear(h, w["o.weight"], w["o.bias"]), atol=1e-5)
        emb = VocabParallelEmbedding("emb.weight", VOCAB, IN, d, torch.float32, cpu)
        emb.load(ck)
        ids = torch.tensor([0, 5, 50, 99, 100, 33])
        emb_ok = torch.equal(emb(ids), F.embedding(ids, w["emb.weight"]))
        head = ParallelLMHead("head", VOCAB, IN, d, torch.float32, cpu)
        head.load(ck)
        logits = head(x)
        head_ok = torch.allclose(logits, x @ w["head.weight"].T, atol=1e-5) if rank == 0 else logits is None
        queue.put((rank, dict(col=col_ok, fused=fused_ok, row=row_ok, emb=emb_ok, head=head_ok)))
        d.shutdown()
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 3])
def test_parallel_layers_equal_dense(tmp_path, world):
    save_file(weights(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(tmp_path), queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(world):
        assert isinstance(results[rank], dict), results[rank]
        assert results[rank] == dict(col=True, fused=True, row=True, emb=True, head=True), (rank, results[rank])


def test_a_16_bit_embedding_table_stays_16_bit_unless_a_head_multiplies_by_it(tmp_path):
    """A bfloat16 table served in float32 keeps its stored bytes (half of float32's); its looked-up rows are the
    float32 of them exactly. A table an LM head is tied to is the head's weight too: it stays float32."""
    from sharding.dist import Dist

    table = torch.randn(VOCAB, IN, generator=torch.Generator().manual_seed(3)).bfloat16()
    save_file({"emb.weight": table}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ids = torch.tensor([[0, 5, 100], [99, 33, 1]])
    cpu = torch.device("cpu")
    with Checkpoint(tmp_path) as ck:
        emb = VocabParallelEmbedding("emb.weight", VOCAB, IN, Dist(), torch.float32, cpu)
        emb.load(ck)
        assert emb.weight.dtype == torch.bfloat16
        out = emb(ids)
        assert out.dtype == torch.float32 and torch.equal(out, F.embedding(ids, table.float()))
        tied = VocabParallelEmbedding("emb.weight", VOCAB, IN, Dist(), torch.float32, cpu)
        head = ParallelLMHead("head", VOCAB, IN, Dist(), torch.float32, cpu, tied_to=tied)
        tied.load(ck)
        assert tied.weight.dtype == torch.float32 and head.weight is tied.weight
        assert torch.equal(tied(ids), out)
