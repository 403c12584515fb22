"""The engine and the scheduler in one process, against a fake executor with scripted logits (vLLM's
test_scheduler.py does the same): no ranks, no model, a step in microseconds.

The fake executor mirrors the block table from each step's updates and stores every token it is given in a cache
addressed by (block, offset). Its "model" predicts the next token from the whole context *as read back through the
block table*, so a wrong block, a bad prefix hit, a chunk at the wrong position or a lost token after a preemption
changes the output. The reference is the same function over the sequence's true tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from server.engine.core import Engine
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.request import Sequence
from server.engine.sampler import SamplingParams
from server.engine.spec_decode.proposers import SpeculativeConfig
from sharding.wire import HIDDEN, LOGITS_ALL, LOGITS_LAST, lora_slot
from tests.tiny import make_tokenizer

SPECIAL = 5  # ids below this are the tiny tokenizer's special tokens (EOS is 2): never predicted


def next_token(context: list[int], vocab: int) -> int:
    """The fake model: a short cycle over the last token (so n-gram drafts are sometimes right), bent by the whole
    context (so every token read from the cache matters)."""
    last = context[-1]
    step = 1 if sum((i + 1) * t for i, t in enumerate(context)) % 5 else 2
    return SPECIAL + (last - SPECIAL + step) % 11 if last >= SPECIAL else SPECIAL + last


def reference(prompt: list[int], n: int, vocab: int, stop: set[int] = frozenset()) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        t = next_token(tokens, vocab)
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
        self.config = SimpleNamespace(vocab_size=vocab)
        self.dist = SimpleNamespace(layout=SimpleNamespace(dp=dp, pp=1))
        self.max_model_len, self.num_blocks, self.block_size = max_model_len, num_blocks, block_size
        self.vocab = vocab
        self.tables: dict[tuple[int, int], dict[int, int]] = {}  # (replica, row) -> {index: block}
        self.cache: dict[tuple[int, int, int], int] = {}  # (replica, block, offset) -> token
        self.failing = set(failing)  # replicas whose next launch fails (their ranks "died")
        self.steps: list[dict] = []

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
            for i in want:
                logits = torch.zeros(self.vocab)
                logits[next_token(context(start + i), self.vocab)] = 8.0
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


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder)), str(folder)


def make_engine(tok, **kw) -> tuple[Engine, FakeRunner]:
    tokenizer, folder = tok
    engine_kw = {k: kw.pop(k) for k in ("max_num_batched_tokens", "speculative", "enable_prefix_caching") if k in kw}
    runner = FakeRunner(folder, len(tokenizer), **kw)
    engine = Engine(runner, tokenizer, max_prefill_tokens_while_decoding=None, **engine_kw)
    return engine, runner


def add(engine: Engine, tokenizer, prompt: list[int], **params) -> Sequence:
    p = SamplingParams(temperature=0.0, ignore_eos=True, **params)
    seq = Sequence(prompt, p, IncrementalDetokenizer(tokenizer, prompt, p.stop, True), emit=lambda *a: None)
    engine.add(seq)
    return seq


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(SPECIAL, 300, (length,), generator=g).tolist() for _ in range(count)]


def test_preemption_recomputes_to_the_same_tokens(tok):
    """Four sequences of 40 tokens in a pool that holds about two: the latest admitted are preempted, recomputed
    with their generated tokens as prompt, and every output equals the reference."""
    engine, runner = make_engine(tok, num_blocks=24, block_size=4)
    seqs = [add(engine, tok[0], p, max_tokens=30) for p in prompts(4, 10)]
    engine.run_until_idle()
    assert engine.num_preemptions > 0
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 30, runner.vocab), s.seq_id
        assert s.finish_reason == "length"
    assert engine.pools[0].usage() == 0  # every block given back


def test_prefix_hits_and_chunked_prefill(tok):
    """A 37-token prompt in chunks of at most 8 tokens (a step budget of 8), then the same prompt again: the
    second one starts from the cached full blocks and computes only the rest, with the same output."""
    engine, runner = make_engine(tok, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompt = prompts(1, 37, seed=1)[0]
    first = add(engine, tok[0], prompt, max_tokens=5)
    engine.run_until_idle()
    chunks = [r for s in runner.steps for r in s["rows"] if r[0] > 1]
    assert [n for n, *_ in chunks] == [8, 8, 8, 8, 5] and [st for _, st, *_ in chunks] == [0, 8, 16, 24, 32]
    runner.steps.clear()
    second = add(engine, tok[0], prompt, max_tokens=5)
    engine.run_until_idle()
    assert first.output_ids == second.output_ids == reference(prompt, 5, runner.vocab)
    assert second.num_cached_prompt == 36  # 9 full blocks of 4
    assert runner.steps[0]["rows"][0][:2] == (1, 36)  # only the last prompt token computed
    assert engine.prefix_hit_tokens == 36


def test_stops_and_prompt_logprobs(tok):
    """A stop token ends the answer at it; prompt logprobs (LOGITS_ALL rows over chunks) are every prompt token's
    logprob under the model, the same as the rows a one-step prefill gives."""
    engine, runner = make_engine(tok, num_blocks=64, max_num_batched_tokens=6)
    prompt = prompts(1, 15, seed=2)[0]
    ref = reference(prompt, 20, runner.vocab)
    stop = ref[6]
    s = add(engine, tok[0], prompt, max_tokens=20, stop_token_ids=[stop], prompt_logprobs=0)
    engine.run_until_idle()
    assert s.output_ids == ref[: ref.index(stop) + 1] and s.finish_reason == "stop"
    hit = torch.log_softmax(torch.tensor([8.0] + [0.0] * (runner.vocab - 1)), 0)
    expected = [float(hit[0]) if next_token(prompt[: i + 1], runner.vocab) == prompt[i + 1] else float(hit[1])
                for i in range(len(prompt) - 1)]
    assert s.prompt_logprobs == pytest.approx(expected)
    assert any(r[2] & LOGITS_ALL and r[0] > 1 for st in runner.steps for r in st["rows"])


def test_speculation_keeps_greedy_outputs_and_rolls_back(tok):
    """n-gram drafts verified as extra decode rows: rejected drafts roll back (their cache slots are written again
    by the next step), accepted ones skip steps, and the output is the reference either way."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine, runner = make_engine(tok, num_blocks=96, speculative=spec)
    seqs = [add(engine, tok[0], p, max_tokens=40) for p in prompts(3, 12, seed=3)]
    engine.run_until_idle()
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 40, runner.vocab)
    assert 0 < engine.spec_accepted_tokens < engine.spec_draft_tokens
    decode_steps = sum(1 for st in runner.steps if st["prefill"] == 0)
    assert decode_steps < 40  # accepted drafts saved steps


def test_a_dead_replica_moves_its_sequences_to_the_other(tok):
    """Two replicas; replica 1's launch fails and the supervisor confirms it: its sequences recompute on replica 0
    and finish with the reference output; replica 1 leaves rotation."""
    engine, runner = make_engine(tok, num_blocks=64, dp=2)
    confirmed = []
    engine.on_replica_failure = lambda replica, reason: confirmed.append((replica, reason)) or True
    seqs = [add(engine, tok[0], p, max_tokens=12) for p in prompts(4, 9, seed=4)]
    engine.step()  # both replicas get work
    runner.failing.add(1)
    engine.run_until_idle()
    assert [r for r, _ in confirmed] == [1] and "connection reset" in confirmed[0][1]
    assert engine.down.keys() == {1} and engine.replicas_alive == 1
    for s in seqs:
        assert s.output_ids == reference(s.prompt_ids, 12, runner.vocab)
    assert any(s.num_preemptions for s in seqs)  # the moved ones were recomputed
