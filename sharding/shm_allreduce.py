"""A shared-memory all-reduce (and broadcast, gather) for CPU ranks on one host: a few us per hidden-size vector
where gloo takes 0.2-0.5 ms.

Set-up: rank 0 creates a file in /dev/shm, sends its name to the others over the (gloo) TP group (a dist.Group), every rank maps
it and reports success through a gloo all-reduce (which is also the barrier), then rank 0 unlinks the name at once:
the mapping lives on while mapped, and no /dev/shm entry can outlive a SIGKILL beyond that millisecond window.

Layout: one int64 sequence counter per rank, each on its own 64-byte cache line, then each rank's pid, then
2 buffers (call parity) x world_size slots of `slot_bytes` each. Protocol of call number n (every rank counts its
calls; a tensor larger than a slot is one call per chunk):
  1. copy my tensor into slot[n % 2][rank], then store counter[rank] = n   (publish: data first, flag second);
  2. wait until counter[j] >= n for every peer j: a short busy spin, then sched_yield, then short sleeps (measured
     best when ranks share cores with other processes); RuntimeError if a peer exits or after `timeout_s`;
  3. sum the slots of buffer n % 2 in rank order ((s0 + s1) + s2) + ... into my tensor. IEEE addition is
     commutative, so ranks 0 and 1 start from their own tensor (s0 + s1 == s1 + s0 bitwise) and save a copy;
     every rank performs the same roundings in the same order, so all ranks get bitwise identical results.

A broadcast is a call of the same sequence: the source copies into its slot of buffer n % 2 and stores n; every
other rank waits for the source's counter to reach n, copies the slot out, then stores its own counter = n. A gather
is the mirror image: every rank but the destination copies into its slot and stores n; the destination waits for
each, copies the slots out, then stores n.

Why two buffers are enough: a rank writes into buffer n % 2 in call n only once it has seen counter[j] >= n - 1 for
every peer j, and a rank stores n - 1 only after it has finished call n - 2 (its sum, or its copy out of the
source's slot): every read of buffer n % 2 is done before anyone can overwrite it. After an all-reduce (which waits
for every peer anyway) this costs nothing; after a broadcast, which waits for the source only, it may wait. A fast
rank that is already in call n + 1 writes the other buffer, which nobody is reading.

Memory ordering: this relies on x86's total store order (TSO): stores become visible in program order and loads
are not reordered with older loads, so a peer that sees counter == n also sees the data stored before it, and a
rank's reads of call n finish before its store of n + 1 is seen. Torch's copy and add kernels use ordinary stores
(a slot of 1 MiB stays far below the sizes at which memcpy switches to non-temporal stores), and the GIL release
around each torch call adds locked instructions (full fences) besides. On weakly ordered CPUs (ARM) this would
need explicit fences: `wanted()` enables it on x86 only. One instance per process, called from one thread.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import torch
import torch.distributed as dist

from loaders import envs

SHM_DIR = "/dev/shm"
LINE = 8  # int64s per 64-byte cache line
NAME_BYTES = 128  # the segment's name, as rank 0 sends it to the others


def wanted(backend: str, world_size: int, local_world_size: int) -> bool:
    """Use it for gloo ranks all on this host and no more ranks than cores; TPSERVE_SHM_ALLREDUCE=0/1 decides."""
    forced = envs.SHM_ALLREDUCE.get()  # None: not set (raises on a value other than 0 or 1)
    if forced and backend != "gloo":
        raise ValueError(f"{envs.SHM_ALLREDUCE.name}=1 needs CPU ranks (gloo), but the backend is {backend}")
    if forced is not None:
        return forced
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return (backend == "gloo" and local_world_size == world_size and world_size <= cores
            and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR))


def _alive(pid: int) -> bool:
    """False once `pid` has exited (including an unreaped zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to a signal probe
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


class ShmAllReduce:
    def __init__(self, rank: int, world_size: int, group=None, *, slot_bytes: int = 1 << 20,
                 timeout_s: float = 60.0, spin: int = 200, yield_s: float = 300e-6):
        assert world_size >= 2, "one rank needs no all-reduce"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.spin, self.yield_s = spin, yield_s  # busy checks (~15 us), then sched_yield, then short sleeps
        self.slot_bytes = -(-slot_bytes // 64) * 64
        self._header = -(-(LINE + 1) * 8 * world_size // 4096) * 4096
        size = self._header + 2 * world_size * self.slot_bytes
        name, error, self._mm = [""], "", None
        if rank == 0:
            name[0] = f"tpserve-allreduce-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                fd = os.open(os.path.join(SHM_DIR, name[0]), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
                finally:
                    os.close(fd)
            except OSError as e:
                name[0], error = "", f"rank 0 could not create {size} bytes in {SHM_DIR}: {e}"
        sent = torch.zeros(NAME_BYTES, dtype=torch.uint8)  # the name, over the group (sharding/dist.py: Group)
        sent[: len(name[0])] = torch.tensor(list(name[0].encode()), dtype=torch.uint8)
        group.broadcast(sent, src=0)
        name[0] = bytes(sent[sent != 0].tolist()).decode()
        path = os.path.join(SHM_DIR, name[0])
        if name[0]:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    self._mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            except OSError as e:  # e.g. a rank on another host or container
                error = f"rank {rank} could not map {path}: {e}"
        if self._mm is not None:
            self._flags = memoryview(self._mm)[: self._header].cast("q")
            self._flags[LINE * world_size + rank] = os.getpid()
        ok = torch.tensor([0 if error else 1])
        group.all_reduce(ok, dist.ReduceOp.MIN)  # also the barrier: everyone has mapped it
        if rank == 0 and name[0]:
            os.unlink(path)
        if not ok.item():
            self.close()
            raise RuntimeError("shared-memory all-reduce could not be set up" + (f": {error}" if error else
                               " on some rank (see its log)"))
        self._pids = [self._flags[LINE * world_size + j] for j in range(world_size)]
        self._check_pids = all(_alive(p) for p in self._pids)  # False if peers live in another pid namespace
        self._peers = [j for j in range(world_size) if j != rank]
        self._seq = 0
        self._synced = 0  # every peer is known to have reached at least this call
        self._bufs: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [2, world, slot elements] view of the data
        self._views: dict[tuple, tuple] = {}  # (dtype, shape) -> per parity, per rank views shaped like the input

    def _buf(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._bufs:
            n = self.slot_bytes // dtype.itemsize
            flat = torch.frombuffer(self._mm, dtype=dtype, offset=self._header, count=2 * self.world_size * n)
            self._bufs[dtype] = flat.view(2, self.world_size, n)
        return self._bufs[dtype]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks in place and return it; every rank gets bitwise identical values."""
        views = self._views.get((t.dtype, t.shape))
        if views is not None and t.is_contiguous():
            self._reduce(t, views[(self._seq + 1) & 1])
            return t
        if self._mm is None:
            raise RuntimeError("shared-memory all-reduce used after close()")
        buf = self._buf(t.dtype)
        cap = buf.shape[-1]
        if t.numel() <= cap and t.is_contiguous():
            if len(self._views) >= 64:
                self._views.clear()
            views = tuple(tuple(buf[p, r, : t.numel()].view(t.shape) for r in range(self.world_size))
                          for p in (0, 1))
            self._views[(t.dtype, t.shape)] = views
            return self.all_reduce(t)
        flat = t.reshape(-1)  # a view when t is contiguous, else a copy written back below
        for start in range(0, flat.numel(), cap):
            piece = flat[start : start + cap]
            self._reduce(piece, [buf[(self._seq + 1) & 1, r, : piece.numel()] for r in range(self.world_size)])
        if not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank `src`'s `t` into every rank's `t` (contiguous, same shape and dtype everywhere), in place.

        The step description goes this way to the ranks every step: no gloo round trip (~0.3 ms median, ~4 ms p90 on
        2 cores). A rank waiting here for the next step sleeps between checks after a moment (see _wait_slow)."""
        buf, flat, cap = self._flat(t, "broadcast")
        for start in range(0, max(1, flat.numel()), cap):
            self._bcast(flat[start : start + cap], buf, src)
        return t

    def _flat(self, t: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The buffers for t's dtype, t as a flat view and the per-call capacity; checks what broadcast and gather
        need (an open segment, a contiguous tensor)."""
        if self._mm is None:
            raise RuntimeError(f"shared-memory {what} used after close()")
        if not t.is_contiguous():
            raise ValueError(f"shared-memory {what} needs a contiguous tensor")
        buf = self._buf(t.dtype)
        return buf, t.view(-1), buf.shape[-1]

    def _bcast(self, t: torch.Tensor, buf: torch.Tensor, src: int) -> None:
        self._seq = n = self._seq + 1
        slot = buf[n & 1, src, : t.numel()]
        if self.rank == src:
            self._await_all(n - 1)  # nobody still reads this buffer's call n - 2
            slot.copy_(t)
            self._flags[LINE * self.rank] = n
        else:
            self._await(src, n)
            t.copy_(slot)
            self._flags[LINE * self.rank] = n  # after the read: src may reuse the buffer once all have said so

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `t` (contiguous, same shape and dtype everywhere) on rank `dst`, in rank order; None on the
        others. The LM head's vocabulary blocks reach rank 0 this way every step."""
        buf, flat, cap = self._flat(t, "gather")
        outs = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == dst else None
        for start in range(0, max(1, flat.numel()), cap):
            self._gather(flat[start : start + cap], buf, dst,
                         None if outs is None else [o[start : start + cap] for o in outs])
        return None if outs is None else [o.view(t.shape) for o in outs]

    def _gather(self, t: torch.Tensor, buf: torch.Tensor, dst: int, outs: list[torch.Tensor] | None) -> None:
        self._seq = n = self._seq + 1
        k = t.numel()
        if outs is None:
            self._await_all(n - 1)  # nobody still reads this buffer's call n - 2
            buf[n & 1, self.rank, :k].copy_(t)
        else:
            outs[self.rank].copy_(t)
            for j in self._peers:
                self._await(j, n)
                outs[j].copy_(buf[n & 1, j, :k])
            self._synced = n
        self._flags[LINE * self.rank] = n  # dst: after its reads, so the others may reuse the buffer

    def _await(self, j: int, n: int) -> None:
        i, flags = LINE * j, self._flags
        for _ in range(self.spin):
            if flags[i] >= n:
                return
        self._wait_slow(j, n)

    def _await_all(self, n: int) -> None:
        if self._synced < n:
            for j in self._peers:
                self._await(j, n)
            self._synced = n

    def _reduce(self, t: torch.Tensor, slots) -> None:
        """One call: publish my slot, wait for every peer's, sum in rank order into `t` (slots: this call's)."""
        self._seq = n = self._seq + 1
        rank, flags = self.rank, self._flags
        self._await_all(n - 1)  # a no-op after an all-reduce; after a broadcast, peers may still read call n - 2
        slots[rank].copy_(t)
        flags[LINE * rank] = n  # after the data: TSO makes peers see the data once they see n
        for j in self._peers:
            self._await(j, n)
        self._synced = n
        if rank < 2:  # t already holds s_rank, and s0 + s1 == s1 + s0 exactly
            t.add_(slots[1 - rank])
        else:
            torch.add(slots[0], slots[1], out=t)
        for s in slots[2:]:
            t.add_(s)

    def _wait_slow(self, j: int, n: int) -> None:
        """Yield the core for `yield_s` (helps a peer queued on this core), then sleep between checks: an idle
        core lets the kernel move a peer waiting behind another process onto it. Fail on a dead or hung peer."""
        start = last_check = time.monotonic()
        while self._flags[LINE * j] < n:
            now = time.monotonic()
            if now - start < self.yield_s:
                os.sched_yield()
                continue
            if now - last_check > 0.1:
                last_check = now
                if self._check_pids and not _alive(self._pids[j]):
                    raise RuntimeError(f"shared-memory collective: rank {j} (pid {self._pids[j]}) has exited; "
                                       f"rank {self.rank} was waiting for it in call {n}")
                if now - start > self.timeout_s:
                    raise RuntimeError(f"shared-memory collective: rank {j} did not reach call {n} within "
                                       f"{self.timeout_s:g} s (it is at call {self._flags[LINE * j]}); it is hung "
                                       f"or the ranks made different sequences of calls")
            time.sleep(1e-5 if now - start < 1.0 else 1e-3)

    def close(self) -> None:
        """Unmap the segment (its name was unlinked at set-up). Views into it are dropped first."""
        self._bufs, self._views = {}, {}
        if self._mm is not None:
            self._flags.release()
            self._mm.close()
            self._mm = None
