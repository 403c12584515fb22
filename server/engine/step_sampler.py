"""From a step's logits to each sequence's new tokens: sampling, the verification of draft tokens, prompt logprobs.

    StepOutput (rows keyed by sequence) -> sample_step() -> {seq_id: NewTokens} -> Scheduler.update_from_output()

Nothing here appends a token or ends a sequence: `Scheduler.update_from_output` does, for every kind of row alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.outputs import Scheduled, SchedulerOutput, StepOutput
from server.engine.request import Sequence
from server.engine.sampler import SampleRow, sample
from server.engine.structured.grammar import Grammars


@dataclass(slots=True)
class NewTokens:
    """What sampling chose for one sequence this step: one token, or after a verification the drafts the model
    agreed with and then its own token. They are appended in order until one ends the sequence."""

    tokens: list[int]
    logprobs: list[float | None]  # each token's logprob, where the sequence asked for logprobs
    top_logprobs: list[list[tuple[int, float]]]  # each token's top alternatives (empty lists when not asked)
    accepted: int = 0  # drafts kept (set by Scheduler.update_from_output: a token that ends the sequence stops it)


def sample_step(batch: SchedulerOutput, out: StepOutput, grammars: Grammars) -> dict[int, NewTokens]:
    """Every sequence of the step that samples: one batched draw for the plain rows (each masked by its grammar),
    then each verification. A chunk of a prompt whose logprobs are owed records them on its sequence here."""
    sampling: list[Scheduled] = []
    verifying: list[Scheduled] = []
    for item in batch.items:
        seq = item.seq
        if seq.finished or seq.pooling is not None:  # (aborted while in flight; embeddings pool, they do not sample)
            continue
        if out[seq].every_token:
            record_prompt_logprobs(seq, out.rows_of(seq), item.start)
            if item.samples:
                sampling.append(item)
        elif item.drafts:
            verifying.append(item)
        elif item.samples:
            sampling.append(item)
    new: dict[int, NewTokens] = {}
    if sampling:
        seqs = [item.seq for item in sampling]
        new.update(zip((s.seq_id for s in seqs), _sample(seqs, out.last_rows(seqs), grammars)))
    for item in verifying:
        new[item.seq.seq_id] = _verify(item, out.rows_of(item.seq), grammars)
    return new


def _sample(seqs: list[Sequence], logits: torch.Tensor, grammars: Grammars) -> list[NewTokens]:
    rows = [SampleRow(s.params, s.generator, s.prompt_ids, s.output_ids, s.banned_ids()) for s in seqs]
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if constrained:  # only these rows pay (the logits are this step's own: masked in place)
        with torch.inference_mode():  # the runner made them under inference mode
            grammars.mask_logits(logits, constrained, [seqs[i].grammar for i in constrained])
    got = sample(logits, rows)
    return [NewTokens([got.token_ids[i]], [got.logprobs[i] if got.logprobs is not None else None],
                      [got.top_logprobs[i] if got.top_logprobs else []]) for i in range(len(seqs))]


def _verify(item: Scheduled, logits: torch.Tensor, grammars: Grammars) -> NewTokens:
    """A sequence's verification rows: row j has the logits after its token and drafts[:j]. Each row is sampled
    as decoding would sample it (its context has the drafts before it as output: penalties, min_tokens, the
    grammar), and the drafts are kept while the sampled token equals them; the first token that differs, or the
    one after the last draft, is the model's own. Greedy: the same tokens as without speculation. Sampling:
    drawing from the target and keeping a draft when the draw equals it is rejection sampling with the
    proposal's probability 1, so the output has exactly the target's distribution; a seeded sequence draws
    row by row and stops at the first difference, so its generator advances exactly as without speculation."""
    seq, drafts = item.seq, item.drafts
    k = len(drafts)
    penalties = seq.params.has_penalties  # only penalties read the output (a copy per row, so only then)
    rows = [SampleRow(seq.params, seq.generator, seq.prompt_ids,
                      seq.output_ids + drafts[:j] if penalties else seq.output_ids, seq.banned_ids(j))
            for j in range(k + 1)]
    grammar = seq.grammar
    with torch.inference_mode():
        if grammar is not None:  # each row masked by the grammar's state after the drafts before it
            consumed = 0
            for j in range(k + 1):
                grammars.mask_logits(logits, [j], [grammar])
                if j < k:
                    if not grammar.accept(drafts[j]):
                        break
                    consumed += 1
            grammar.matcher.rollback(consumed)
        if seq.generator is not None and not seq.params.greedy:
            tokens, lps, tops = [], [], []
            for j in range(k + 1):
                one = sample(logits[j : j + 1], rows[j : j + 1])
                tokens.append(one.token_ids[0])
                lps.append(one.logprobs[0] if one.logprobs else None)
                tops.append(one.top_logprobs[0] if one.top_logprobs else [])
                if j == k or tokens[-1] != drafts[j]:
                    break
        else:
            got = sample(logits, rows)
            tokens, lps = got.token_ids, got.logprobs or [None] * (k + 1)
            tops = got.top_logprobs or [[] for _ in range(k + 1)]
    return NewTokens(tokens, lps, tops)


def record_prompt_logprobs(seq: Sequence, logits: torch.Tensor, start: int) -> None:
    """Logits came for every token of a chunk of the prompt: row j predicts the token at start + j + 1. Record
    each prompt token's logprob (and top alternatives) under the model's own distribution, once (a recomputed
    chunk after a preemption adds nothing)."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs, seq.prompt_top_logprobs = [], []
    first = len(seq.prompt_logprobs) + 1  # the next prompt position without a logprob
    last = min(start + logits.shape[0], len(seq.prompt_ids) - 1)
    if last < first:
        return
    lp = torch.log_softmax(logits[first - 1 - start : last - start].float(), dim=-1)
    target = torch.tensor(seq.prompt_ids[first : last + 1], dtype=torch.int64)
    seq.prompt_logprobs += lp.gather(1, target[:, None]).squeeze(1).tolist()
    k = seq.params.prompt_logprobs or 0
    if k:
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        seq.prompt_top_logprobs += [list(zip(r_i, r_v)) for r_i, r_v in zip(idx.tolist(), vals.tolist())]
    else:
        seq.prompt_top_logprobs += [[] for _ in range(last - first + 1)]
