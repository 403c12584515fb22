"""A fake executor for in-process engine tests (tests/server/test_engine_inprocess.py, test_api_inprocess.py): what
the engine asks of the ranks, computed in Python over a mirrored block table, with scripted logits.

It mirrors the block table from each step's updates and stores every token it is given in a cache addressed by
(block, offset). Its "model" predicts the next token from the whole context *as read back through the block table*,
so a wrong block, a bad prefix hit, a chunk at the wrong position or a lost token after a preemption changes the
output; a LoRA slot shifts the prediction, so a row served with the wrong adapter does too. The reference is the same
function over the sequence's true tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from server.engine.core import Engine
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.request import Sequence
from server.engine.sampler import SamplingParams
from sharding.wire import HIDDEN, LOGITS_ALL, LOGITS_LAST, lora_slot

SPECIAL = 5  # ids below this are the tiny tokenizer's special tokens (EOS is 2): never predicted


def next_token(context: list[int], vocab: int, shift: int = 0) -> int:
    """The fake model: a short cycle over the last token (so n-gram drafts are sometimes right), bent by the whole
    context (so every token read from the cache matters); an adapter shifts the cycle."""
    last = context[-1]
    step = (1 if sum((i + 1) * t for i, t in enumerate(context)) % 5 else 2) + shift
    return SPECIAL + (last - SPECIAL + step) % 11 if last >= SPECIAL else SPECIAL + last


def adapter_shift(path: str) -> int:
    """An adapter folder named `.../aN` shifts the fake model by N."""
    return int(path.rstrip("/").rsplit("/a", 1)[1])


def reference(prompt: list[int], n: int, vocab: int, stop: set[int] = frozenset(), shift: int = 0) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        t = next_token(tokens, vocab, shift)
        tokens.append(t)
        out.append(t)
        if t in stop:
            break
    return out


@dataclass
class FakeLaunched:
    step: object
    logits: torch.Tensor
    pooled: torch.Tensor | None


class FakeRunner:
    """What the engine asks of sharding/executor.py Executor, computed in Python over a mirrored cache."""

    def __init__(self, model: str, vocab: int, num_blocks: int, block_size: int = 4, max_num_seqs: int = 4,
                 max_model_len: int = 96, dp: int = 1, failing: set[int] = frozenset()):
        self.cfg = SimpleNamespace(max_num_seqs=max_num_seqs, model=model)
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=1)  # (a pooled row is one number)
        self.dist = SimpleNamespace(layout=SimpleNamespace(dp=dp, pp=1))
        self.max_model_len, self.num_blocks, self.block_size = max_model_len, num_blocks, block_size
        self.vocab = vocab
        self.thread_id = None  # (the engine warns when it steps on another thread than the loader's: it does here)
        self.model = SimpleNamespace(layers=[])  # (the API's expert metrics look for MoE layers in it: none)
        self.tables: dict[tuple[int, int], dict[int, int]] = {}  # (replica, row) -> {index: block}
        self.cache: dict[tuple[int, int, int], int] = {}  # (replica, block, offset) -> token
        self.failing = set(failing)  # replicas whose next launch fails (their ranks "died")
        self.steps: list[dict] = []
        self.slots: dict[tuple[int, int], str] = {}  # (replica, LoRA slot) -> adapter folder ("rank 0" is -1)
        self.lora_calls: list[tuple] = []

    def launch(self, step, replica: int = 0) -> FakeLaunched:
        if replica in self.failing:
            raise RuntimeError("connection reset by peer")
        bs = self.block_size
        if step.block_updates is not None:
            for row, index, block in step.block_updates.tolist():
                self.tables.setdefault((replica, row), {})[index] = block
        ids = step.input_ids.tolist()
        rows, pooled, at = [], [], 0
        kinds = {"decode": 0, "prefill": 0, "rows": []}
        for row, n, start, flags in step.seq_table.tolist():
            table = self.tables[(replica, row)]
            for i in range(n):  # the step's tokens go into the cache first, as attention writes K/V
                p = start + i
                self.cache[(replica, table[p // bs], p % bs)] = ids[at + i]

            def context(p: int) -> list[int]:
                return [self.cache[(replica, table[q // bs], q % bs)] for q in range(p + 1)]

            want = range(n) if flags & LOGITS_ALL else [n - 1] if flags & LOGITS_LAST else []
            slot = lora_slot(flags)
            shift = adapter_shift(self.slots[(replica, slot)]) if slot else 0
            for i in want:
                logits = torch.zeros(self.vocab)
                logits[next_token(context(start + i), self.vocab, shift)] = 8.0
                rows.append(logits)
            if flags & HIDDEN:
                pooled.append(torch.tensor([float(sum(context(start + n - 1)))]))
            kinds["decode" if n == 1 else "prefill"] += 1
            kinds["rows"].append((n, start, flags & 0xFFFF, lora_slot(flags)))
            at += n
        self.steps.append(kinds)
        logits = torch.stack(rows) if rows else torch.zeros(0, self.vocab)
        return FakeLaunched(step, logits, torch.stack(pooled) if pooled else None)

    def collect(self, launched: FakeLaunched) -> torch.Tensor:
        return launched.logits

    def heartbeat(self, replicas=None) -> None:
        pass

    def forget_sends(self, replica: int) -> None:
        pass

    def lora_load(self, slot: int, path: str, replicas: list[int], rank0: bool) -> None:
        self.lora_calls.append(("load", slot, path, tuple(replicas), rank0))
        for r in ([-1] if rank0 else []) + list(replicas):
            self.slots[(r, slot)] = path

    def lora_unload(self, slot: int, replicas: list[int]) -> None:
        self.lora_calls.append(("unload", slot, tuple(replicas)))
        for r in list(replicas) or [-1]:
            self.slots.pop((r, slot), None)


def make_engine(tok, **kw) -> tuple[Engine, FakeRunner]:
    tokenizer, folder = tok
    engine_kw = {k: kw.pop(k) for k in ("max_num_batched_tokens", "speculative", "enable_prefix_caching") if k in kw}
    runner = FakeRunner(folder, len(tokenizer), **kw)
    engine = Engine(runner, tokenizer, max_prefill_tokens_while_decoding=None, **engine_kw)
    return engine, runner


def add(engine: Engine, tokenizer, prompt: list[int], lora=None, **params) -> Sequence:
    p = SamplingParams(temperature=0.0, ignore_eos=True, **params)
    seq = Sequence(prompt, p, IncrementalDetokenizer(tokenizer, prompt, p.stop, True), emit=lambda *a: None)
    seq.lora = lora
    engine.add(seq)
    return seq


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(SPECIAL, 300, (length,), generator=g).tolist() for _ in range(count)]


