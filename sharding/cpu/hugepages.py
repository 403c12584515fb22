"""The streamed weights in transparent huge pages (Linux, CPU).

A decode step at batch 1 reads every weight once, front to back: SmolLM2-135M in float32 is ~540 MB, 130,000 pages
of 4 KiB. Each page costs a TLB miss and a page walk, and the CPU's prefetchers stop at page boundaries. Where the
kernel's transparent huge pages are `madvise` (this host's setting, and a common distribution default), memory from
malloc (torch's CPU allocator) stays in 4 KiB pages unless the program asks for huge ones.

So after load, `move_weights` copies every linear's weight in its kernel layout (`blocked` float32, or a quantized
weight's bytes and scales) into one anonymous mapping advised `MADV_HUGEPAGE` before it is first touched, and points
the modules at it. Measured on a 2-vCPU Zen 4 (SmolLM2 float32, TP=1, processes alternating): 11.6 / 12.6 ->
10.8 / 10.8 ms per token (BENCHMARKS.md section 12). Peak memory grows by about one tensor (each old copy is freed
after its move, and the heap's free pages go back to the OS every 32 MiB moved); loading takes ~1 s more per GB (the
kernel zeroes and compacts 2 MiB pages). A host with huge pages off (`never`) or without the sysfs switch keeps the
weights where they are, as does `TPSERVE_HUGE_PAGES=0`.

The KV cache's pools are one such mapping too (`zeros`): decode attention reads every sequence's blocks each step,
a 4 KiB page per head and block of 16 float32 keys of 64; over 30 layers' pools, 3-9 % less time than in 4 KiB
pages (1 to 32 sequences of 1,000-4,000 keys, Zen 4).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
from pathlib import Path

import torch

from loaders import envs
from sharding.layers import quant

logger = logging.getLogger("tpserve")

THP = Path("/sys/kernel/mm/transparent_hugepage")
ALIGN = 64  # bytes between tensors in the arena: a cache line (the kernels' vector loads)


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'), or '' where there is none."""
    try:
        text = (THP / "enabled").read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else ""


def huge_page_size() -> int:
    try:
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def enabled() -> bool:
    return (envs.HUGE_PAGES.get() and hasattr(mmap, "MADV_HUGEPAGE")
            and thp_mode() in ("always", "madvise"))


def huge_empty(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed uint8 memory, aligned to a huge page, advised MADV_HUGEPAGE before its first touch. The
    tensor keeps the mapping alive (torch.frombuffer holds it); the mapping is unmapped when the last view is gone."""
    page = huge_page_size()
    # anonymous and private (a shared mapping is shmem, which huge pages treat apart): zero-filled, populated on first
    # touch; one page more than needed, to start on a huge-page boundary
    mm = mmap.mmap(-1, (-(-nbytes // page) + 1) * page, flags=mmap.MAP_PRIVATE)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel that refuses the advice: plain pages, still correct memory
        pass
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    start = -buf.data_ptr() % page
    return buf[start : start + nbytes]


def _views(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """A tensor of each (shape, dtype), consecutive parts of one huge-page mapping (64-byte aligned), untouched."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // ALIGN) * ALIGN)
    arena = huge_empty(starts[-1])
    return [arena[a : a + n].view(dtype).view(shape) for (shape, dtype), a, n in zip(specs, starts, sizes)]


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """A zeroed tensor of each shape: on a CPU where the OS allows, parts of one mapping in huge pages (the KV
    cache's pools: decode attention reads every sequence's blocks each step), written once so that they are resident
    from the start as torch.zeros' are; else torch.zeros each."""
    if device.type != "cpu" or not enabled():
        return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    out = _views([(shape, dtype) for shape in shapes])
    for t in out:
        t.zero_()  # the pages are zero already; this makes them resident
    return out


TRIM_EVERY = 32 << 20  # bytes moved between two malloc_trim calls


def _glibc(name: str):
    """glibc's function `name`, or None (another C library)."""
    if name not in _GLIBC:
        try:
            _GLIBC[name] = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
        except (OSError, AttributeError):
            _GLIBC[name] = None
    return _GLIBC[name]


_GLIBC: dict = {}


def _trim() -> None:
    """Give the heap's free pages back to the OS (glibc). The old copies are freed as they move, but glibc keeps
    freed chunks of up to 32 MiB in its heap, so without this the process's peak memory grew by most of the model
    (SmolLM2 float32: +380 MB)."""
    if (malloc_trim := _glibc("malloc_trim")) is not None:
        malloc_trim(0)


class LoadTrim:
    """Called with the bytes read so far as a rank loads its weights: every CHECK_EVERY bytes it asks glibc how much
    freed memory its heap holds, and gives the free pages back to the OS (malloc_trim) when that passes SLACK.

    The load's temporaries (a layer's weights as read, their float32 copies, the quantizer's intermediates) are freed
    as it goes, but the packed weights it keeps are allocated between them, and many of the holes they leave are then
    too small for the next temporaries: the heap grows by much of what the load allocates. Where the tensors are
    large, glibc maps each on its own and that does not happen; an MoE's experts are small, and a process that had
    freed a large tensor before loading had raised glibc's threshold for that to 32 MiB. The 30B-A3B geometry's 12
    layers at `-q int4`, first start (quantizing): peak 13.8 GB, and 24+ GB (killed by the OOM killer on this 24 GB
    host) after a 235 MB tensor had been freed; with this, 5.2 and 5.8 GB, and no slower (BENCHMARKS.md section
    37). Holding every temporary in a mapping of its own instead (mallopt's M_MMAP_THRESHOLD) bounded the peak too but
    made that start 45 % slower: each temporary's pages faulted in anew."""

    CHECK_EVERY = 256 << 20
    SLACK = 512 << 20

    def __init__(self) -> None:
        self.checked = 0

    def __call__(self, bytes_read: int) -> None:
        if bytes_read - self.checked < self.CHECK_EVERY:
            return
        self.checked = bytes_read
        free = _heap_free()
        if free is None or free > self.SLACK:  # (without mallinfo2, trim at every check)
            _trim()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                 "uordblks", "fordblks", "keepcost")]


def _heap_free() -> int | None:
    """Bytes glibc holds freed in its heaps (mallinfo2's fordblks, every arena), or None (no mallinfo2)."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)


def _slots(model: torch.nn.Module) -> tuple[list[tuple[torch.nn.Module | quant.QuantizedWeight, str]],
                                            list[quant.QuantizedWeight]]:
    """(owner, attribute) of every streamed weight tensor, and the quantized weights to re-bind after the move."""
    slots, quantized = [], []
    for m in model.modules():
        if isinstance(getattr(m, "blocked", None), torch.Tensor):
            slots.append((m, "blocked"))
        qw = getattr(m, "qweight", None)
        for part in (qw.parts or [qw]) if qw is not None else ():
            slots += [(part, "data"), (part, "scale")]
            quantized.append(part)
    slots = [(o, a) for o, a in slots if _movable(getattr(o, a))]
    return slots, quantized


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0


def move_weights(model: torch.nn.Module) -> int:
    """Move the model's streamed weights into huge pages where the OS allows (see the module's docstring). Returns
    the bytes moved (0: nothing done). Call once, after quantization and prepacking, before the first step."""
    if not enabled():
        return 0
    slots, quantized = _slots(model)
    if not slots:
        return 0
    for qw in quantized:
        qw.kernel = None  # its arguments hold the old tensors; bound again below
    targets = _views([(getattr(o, a).shape, getattr(o, a).dtype) for o, a in slots])
    total = unreturned = 0
    for (owner, attr), moved in zip(slots, targets):
        moved.copy_(getattr(owner, attr))
        setattr(owner, attr, moved)  # the old copy is freed here
        total += moved.nbytes
        unreturned += moved.nbytes
        if unreturned >= TRIM_EVERY:
            _trim()
            unreturned = 0
    for qw in quantized:
        quant.bind(qw)  # the compiled op's arguments point at the moved tensors
    _trim()
    logger.debug("%.1f MiB of weights in huge pages", total / 2**20)
    return total
