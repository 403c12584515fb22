"""The shared-memory all-reduce, run on 2 and 3 real ranks, equals gloo's and gives every rank identical bits; its
broadcast and gather, mixed into the same call sequence, deliver the right tensors."""

import hashlib
import os
import signal
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from sharding import shm_allreduce
from sharding.dist import init_dist
from sharding.shm_allreduce import SHM_DIR, ShmAllReduce

CASES = [((576,), torch.float32), ((3, 576), torch.bfloat16), ((2, 3, 5), torch.float32), ((1,), torch.bfloat16),
         ((7, 300), torch.float16)]
SMALL_SLOT = 4096  # bytes: 1024 float32 per slot, so the chunk cases below take several calls and a remainder


def ours(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"tpserve-allreduce-{pid}-")]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def join(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TPSERVE_STORE_PORT=str(port), TPSERVE_STORE_SECRET="hand-made-ranks-" + str(port),
                      TPSERVE_THREADS="1", TPSERVE_COLLECTIVE_TIMEOUT="30", TPSERVE_SHM_ALLREDUCE="1")


def check_rank(rank: int, world: int, port: int, queue) -> None:
    try:
        join(rank, world, port)
        d = init_dist()
        fast = d.fast_all_reduce
        assert isinstance(fast, ShmAllReduce)
        small = ShmAllReduce(rank, world, d.cpu_group, slot_bytes=SMALL_SLOT, timeout_s=30)
        assert not ours(os.getpid()), "the /dev/shm name must be unlinked right after set-up"
        mismatches, digests = [], []
        cases = [(fast, s, dt) for s, dt in CASES] + [
            (small, (2500,), torch.float32), (small, (5, 1000), torch.bfloat16),  # chunks of 1024 / 2048
            (fast, (300_000,), torch.float32)]  # 1.2 MB > the default 1 MiB slot
        for k, (ar, shape, dtype) in enumerate(cases):
            g = torch.Generator().manual_seed(1000 * k + rank)
            x = torch.randint(-8, 8, shape, generator=g).to(dtype)  # integer sums: exact in any order
            want = x.clone()
            d.cpu_group.all_reduce(want)
            if not torch.equal(ar.all_reduce(x), want):
                mismatches.append((k, shape, dtype))
            y = torch.randn(shape, generator=g).to(dtype)  # rounding: ranks must still agree bit for bit
            want = y.clone()
            d.cpu_group.all_reduce(want)
            digests.append(digest(ar.all_reduce(y)))
            eps = torch.finfo(dtype).eps * 8  # gloo may add in another order: a few roundings apart
            if not torch.allclose(y.float(), want.float(), rtol=eps, atol=eps * world):
                mismatches.append((k, shape, dtype, "random"))
        # non-contiguous input: written back in place
        z = torch.arange(12, dtype=torch.float32).view(3, 4).t()
        if not torch.equal(fast.all_reduce(z), torch.arange(12, dtype=torch.float32).view(3, 4).t() * world):
            mismatches.append("non-contiguous")
        # many calls with no barrier in between, ranks racing (and now and then one stalls): the parity logic
        h = hashlib.sha256()
        for i in range(2000):
            if i % 97 == rank:
                time.sleep(0.002)
            a = torch.full((576,), float((7 * i + rank) % 13))
            if fast.all_reduce(a)[0].item() != sum((7 * i + r) % 13 for r in range(world)) or a.min() != a.max():
                mismatches.append(("race", i))
            b = torch.randn(2, 576, generator=torch.Generator().manual_seed(i * world + rank))
            h.update(digest(small.all_reduce(b) if i % 2 else fast.all_reduce(b)).encode())
        digests.append(h.hexdigest())
        # broadcasts mixed into the same call sequence: back to back (the source must not overwrite a buffer a slow
        # rank still reads), chunked through the small slots, int64 like the step message, between all-reduces
        rng = torch.Generator().manual_seed(7)  # the same schedule on every rank
        for i in range(1500):
            kind = int(torch.randint(0, 4, (1,), generator=rng))
            n = int(torch.randint(1, 3000, (1,), generator=rng))
            if i % 89 == rank:
                time.sleep(0.002)
            ar = small if kind == 2 else fast
            if kind == 1:  # a gather to rank 0 (the LM head's blocks), chunked through the small slots when long
                g = torch.arange(n, dtype=torch.float32) + 1000 * rank + i
                got = (small if n % 2 else fast).gather(g, dst=0)
                want = [torch.arange(n, dtype=torch.float32) + 1000 * r + i for r in range(world)]
                if (got is None) != (rank != 0) or (got is not None and not all(map(torch.equal, got, want))):
                    mismatches.append(("gather", i, n))
                continue
            if kind == 3:
                a = torch.full((576,), float(rank + i))
                if ar.all_reduce(a)[0].item() != sum(r + i for r in range(world)):
                    mismatches.append(("mixed all-reduce", i))
                continue
            msg = torch.arange(n, dtype=torch.int64) * (i + 1) if rank == 0 else torch.full((n,), -1, dtype=torch.int64)
            if not torch.equal(ar.broadcast(msg, src=0), torch.arange(n, dtype=torch.int64) * (i + 1)):
                mismatches.append(("broadcast", i, n))
        x = torch.full((5,), float(rank))
        if not torch.equal(fast.broadcast(x, src=world - 1), torch.full((5,), float(world - 1))):
            mismatches.append("broadcast from the last rank")
        small.close()
        try:
            small.all_reduce(torch.ones(3))
            mismatches.append("no error after close")
        except RuntimeError:
            pass
        queue.put((rank, dict(mismatches=mismatches, digests=digests, pid=os.getpid())))
        d.shutdown()
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def killed_peer_rank(rank: int, world: int, port: int, queue) -> None:
    try:
        join(rank, world, port)
        d = init_dist()
        t = torch.ones(576)
        d.all_reduce(t)
        queue.put((rank, dict(pid=os.getpid(), first=t[0].item())))
        if rank == 1:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            d.all_reduce(t)
            queue.put((rank, "all_reduce returned although rank 1 is dead"))
        except RuntimeError as e:
            queue.put((rank, dict(error=str(e), seconds=time.monotonic() - start)))
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def run(target, world: int, reports: int, timeout: float = 60.0) -> list:
    """Start `world` ranks on `target`, collect `reports` queue items (bounded wait), then reap every process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        return [queue.get(timeout=max(0.1, deadline - time.monotonic())) for _ in range(reports)]
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
@pytest.mark.parametrize("world", [2, 3])
def test_equals_gloo_and_ranks_agree(world):
    results = dict(run(check_rank, world, world))
    for rank in range(world):
        assert isinstance(results[rank], dict), results[rank]
        assert results[rank]["mismatches"] == [], (rank, results[rank]["mismatches"])
        assert results[rank]["digests"] == results[0]["digests"], f"rank {rank} diverged from rank 0"
        assert not ours(results[rank]["pid"])


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
def test_dead_peer_raises_quickly_and_leaves_nothing():
    reports = run(killed_peer_rank, 2, 3)  # both first results, then rank 0's error
    firsts = {r: x for r, x in reports if isinstance(x, dict) and "first" in x}
    assert set(firsts) == {0, 1} and all(x["first"] == 2.0 for x in firsts.values()), reports
    (last,) = [x for r, x in reports if r == 0 and not (isinstance(x, dict) and "first" in x)]
    assert isinstance(last, dict), last
    assert "rank 1" in last["error"] and "exited" in last["error"] and last["seconds"] < 5, last
    assert not ours(firsts[0]["pid"]) and not ours(firsts[1]["pid"])


def test_wanted(monkeypatch):
    monkeypatch.setenv("TPSERVE_SHM_ALLREDUCE", "0")
    assert not shm_allreduce.wanted("gloo", 2, 2)
    monkeypatch.setenv("TPSERVE_SHM_ALLREDUCE", "1")
    assert shm_allreduce.wanted("gloo", 64, 1)
    with pytest.raises(ValueError, match="CPU ranks"):
        shm_allreduce.wanted("nccl", 2, 2)
    monkeypatch.setenv("TPSERVE_SHM_ALLREDUCE", "yes")
    with pytest.raises(ValueError, match="0 .off. or 1"):
        shm_allreduce.wanted("gloo", 2, 2)
    monkeypatch.delenv("TPSERVE_SHM_ALLREDUCE")
    assert not shm_allreduce.wanted("gloo", 2, 1)  # a rank on another host
    assert not shm_allreduce.wanted("nccl", 2, 2)
    assert not shm_allreduce.wanted("gloo", 10_000, 10_000)  # more ranks than cores
