"""A rank that cannot read its part of a LoRA adapter, in one process (the real server's case, a respawned rank that
finds an adapter truncated, is in test_lora_server.py): the rank reports it and keeps serving (sharding/worker.py),
rank 0 reads the reports (sharding/executor.py: lora_reports), and the engine fails the request that needed the
adapter, and only it (server/engine/lora_registry.py: LoraSlots)."""

from __future__ import annotations

import datetime
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from loaders.adapters import AdapterFiles, LoraError, read_adapter
from server.engine.core import Engine
from server.engine.lora_registry import Adapter, LoraRegistry
from sharding.executor import Executor, LoadTicket
from sharding.layers.linear import ColumnParallelLinear, Piece, RowParallelLinear
from sharding.layers.lora import LoraManager, encode_load, load_report_key, report_load
from sharding.wire import CMD_LORA_LOAD, CMD_LORA_UNLOAD
from sharding.worker import Worker
from tests.helpers.fake_executor import FakeRunner, add, prompts, reference
from tests.tiny import make_tokenizer

Q = "base_model.model.model.layers.0.self_attn.q_proj"


def peft_folder(folder, seed: int, a_shape=(2, 8), b_shape=(8, 2)):
    """A PEFT LoRA folder (rank 2 on one q_proj), written as save_pretrained writes it."""
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    g = torch.Generator().manual_seed(seed)
    save_file({f"{Q}.lora_A.weight": torch.randn(*a_shape, generator=g),
               f"{Q}.lora_B.weight": torch.randn(*b_shape, generator=g)}, str(folder / "adapter_model.safetensors"))
    return folder


class RankLora:
    """A rank's LoraManager as the worker drives it: `load` parses the folder (read_adapter) and reads its tensors by
    byte ranges (AdapterFiles), as sharding/layers/lora.py does."""

    def __init__(self):
        self.slots: dict[int, dict] = {}

    def load(self, slot: int, path: str) -> None:
        info = read_adapter(path)
        with AdapterFiles(info) as files:
            self.slots[slot] = {name: files.read(name) for name in info.tensors}

    def unload(self, slot: int) -> None:
        self.slots.pop(slot, None)


def test_a_rank_reports_a_load_it_cannot_read_and_keeps_serving(tmp_path, monkeypatch):
    def no_exit(code):
        raise AssertionError(f"the rank called os._exit({code})")

    monkeypatch.setattr("sharding.worker.os._exit", no_exit)
    store = dist.HashStore()
    runner = SimpleNamespace(dist=SimpleNamespace(store=store, global_rank=3), cfg=SimpleNamespace(max_num_seqs=4),
                             lora=RankLora())
    worker = Worker(runner)
    old, new = peft_folder(tmp_path / "old", 1), peft_folder(tmp_path / "new", 2)
    worker._apply_command(CMD_LORA_LOAD, encode_load(1, str(old), 11))
    assert store.get(load_report_key(11, 3)) == b"ok" and 1 in runner.lora.slots
    whole = (new / "adapter_model.safetensors").read_bytes()
    (new / "adapter_model.safetensors").write_bytes(whole[:-20])  # changed after rank 0 read it
    worker._apply_command(CMD_LORA_LOAD, encode_load(1, str(new), 12))
    report = store.get(load_report_key(12, 3)).decode()
    assert "inconsistent offsets" in report and "adapter_model.safetensors" in report, report
    assert 1 not in runner.lora.slots  # neither the new adapter nor the one the slot held before
    (new / "adapter_model.safetensors").write_bytes(whole)
    worker._apply_command(CMD_LORA_LOAD, encode_load(1, str(new), 13))  # the same rank reads the next load
    assert store.get(load_report_key(13, 3)) == b"ok" and 1 in runner.lora.slots
    worker._apply_command(CMD_LORA_UNLOAD, torch.tensor([1]))
    assert 1 not in runner.lora.slots


def test_rank_0_reads_the_reports_without_waiting_or_until_they_come():
    store = dist.HashStore()
    executor = Executor.__new__(Executor)  # (only its store is used)
    executor.dist = SimpleNamespace(store=store, timeout=datetime.timedelta(seconds=30))
    ticket = LoadTicket(42, [1, 2])
    assert executor.lora_reports(ticket, wait=False) is None
    report_load(store, 42, 1, None)
    assert executor.lora_reports(ticket, wait=False) is None  # rank 2 has not reported
    report_load(store, 42, 2, "adapter_model.safetensors: inconsistent offsets")
    assert executor.lora_reports(ticket, wait=True) == {2: "adapter_model.safetensors: inconsistent offsets"}
    assert not any(store.check([load_report_key(42, r)]) for r in (1, 2))  # read once, then deleted
    with pytest.raises(RuntimeError, match="did not report"):  # a replica taken down meanwhile ends the wait
        executor.lora_reports(LoadTicket(43, [1]), wait=True, gone=lambda: True)


class RanksThatReport(FakeRunner):
    """The fake executor with ranks beside rank 0 that report each load: those of folders in `unreadable` fail
    (their slot stays empty on the replica, so a step that used it would not find the adapter)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.unreadable: set[str] = set()
        self._reports: dict[int, dict[int, str]] = {}
        self._ids = itertools.count(1)
        self.waited: list[bool] = []

    def lora_load(self, slot, path, replicas, rank0):
        super().lora_load(slot, path, replicas, rank0)
        if not replicas:
            return None
        ticket = LoadTicket(next(self._ids), [1])
        self._reports[ticket.id] = {}
        if path in self.unreadable:
            for r in replicas:
                self.slots.pop((r, slot))
            self._reports[ticket.id] = {1: f"{path}/adapter_model.safetensors: inconsistent offsets (file truncated?)"}
        return ticket

    def lora_reports(self, ticket, wait, gone=lambda: False):
        self.waited.append(wait)
        return self._reports.pop(ticket.id)


def engine_with_two_adapters(folder, runner_class):
    """An engine over `runner_class` (a fake executor) with adapters a1 and a2 registered: (tokenizer, runner,
    engine, registry, a1, a2)."""
    from transformers import AutoTokenizer

    make_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    runner = runner_class(str(folder), len(tokenizer), num_blocks=64)
    engine = Engine(runner, tokenizer, max_prefill_tokens_while_decoding=None)
    registry = LoraRegistry("unused", "base", max_loras=2, max_cpu_loras=2, max_rank=8)
    good, bad = Adapter("a1", "/adapters/a1"), Adapter("a2", "/adapters/a2")
    registry.register(good)
    registry.register(bad)
    engine.enable_lora(registry)
    return tokenizer, runner, engine, registry, good, bad


def test_a_rank_that_cannot_read_an_adapter_fails_that_request_only(tmp_path):
    tokenizer, runner, engine, registry, good, bad = engine_with_two_adapters(tmp_path, RanksThatReport)
    runner.unreadable.add(bad.path)
    ps = prompts(3, 7, seed=3)
    seqs = [add(engine, tokenizer, ps[0], lora=good, max_tokens=8), add(engine, tokenizer, ps[1], lora=bad, max_tokens=8),
            add(engine, tokenizer, ps[2], max_tokens=8)]
    engine.run_until_idle()
    assert seqs[1].finish_reason == "error" and "'a2' could not be read on rank 1" in seqs[1].error, seqs[1].error
    assert seqs[0].output_ids == reference(ps[0], 8, runner.vocab, shift=1)  # the others are served
    assert seqs[2].output_ids == reference(ps[2], 8, runner.vocab)
    assert bad.slot == 0 and bad not in registry.slots  # freed on every rank: read again when next needed
    assert runner.waited and all(runner.waited)  # the replica had nothing in flight: its ranks were waited for
    runner.unreadable.clear()  # the folder is whole again
    again = add(engine, tokenizer, ps[1], lora=bad, max_tokens=8)
    engine.run_until_idle()
    assert again.output_ids == reference(ps[1], 8, runner.vocab, shift=2)


class TwoLinears(torch.nn.Module):
    """The smallest model LoraManager adapts: layer 0's q_proj (column-parallel) and o_proj (row-parallel), 8 x 8."""

    supports_lora, first_stage, last_stage = True, True, True

    def __init__(self):
        super().__init__()
        name = Q[len("base_model.model."):]
        self.q = ColumnParallelLinear(8, [Piece(name, 0, 8, (8, 8))], False, torch.float32, torch.device("cpu"))
        self.o = RowParallelLinear(Piece(name.replace("q_proj", "o_proj"), 0, 8, (8, 8)), False, None, torch.float32,
                                   torch.device("cpu"))
        self.changes = 0

    def lora_changed(self) -> None:
        self.changes += 1


def test_a_slot_load_checks_every_shape_against_its_linear(tmp_path):
    """Rank 0 checks an adapter against the base checkpoint once, when it is registered; every slot load reads the
    files again. One rewritten meanwhile with other (self-consistent) shapes is refused by that load, on each rank
    (LoraError, a ValueError: the per-load failure report), and the slot keeps what it held. Before, only the rank
    was checked: the slot took an A^T of the wrong width and the first step that used it failed on every rank."""
    model = TwoLinears()
    manager = LoraManager(model, num_slots=2, max_rank=8)
    folder = peft_folder(tmp_path / "a", 1)
    manager.load(1, str(folder))
    held = manager.columns[0][1].slots[1]
    assert held is not None and held[0].shape == (8, 2)
    for a_shape, b_shape in (((2, 16), (8, 2)), ((2, 8), (4, 2))):  # A's input, or B's output, not the linear's
        peft_folder(folder, 2, a_shape, b_shape)  # rewritten in place (read_adapter alone finds nothing wrong)
        with pytest.raises(LoraError, match=r"needs \[2, 8\] and \[8, 2\]"):
            manager.load(1, str(folder))
        assert manager.columns[0][1].slots[1] is held  # the slot is as it was
    peft_folder(folder, 3)
    manager.load(2, str(folder))  # the folder whole again: it loads


class RankZeroThatBreaks(FakeRunner):
    """The fake executor whose rank 0 fails reading the folders in `broken` with an error that is no ValueError or
    OSError (a torch RuntimeError, say)."""

    broken: set[str] = set()

    def lora_load(self, slot, path, replicas, rank0):
        if rank0 and path in self.broken:
            raise RuntimeError("shape '[2, 8]' is invalid for input of size 17")
        return super().lora_load(slot, path, replicas, rank0)


def test_any_error_reading_an_adapter_on_rank_0_fails_that_load_not_the_engine(tmp_path):
    tokenizer, runner, engine, registry, good, bad = engine_with_two_adapters(tmp_path, RankZeroThatBreaks)
    runner.broken = {bad.path}
    ps = prompts(3, 7, seed=4)
    seqs = [add(engine, tokenizer, ps[0], lora=good, max_tokens=4), add(engine, tokenizer, ps[1], lora=bad, max_tokens=4),
            add(engine, tokenizer, ps[2], max_tokens=4)]
    engine.run_until_idle()
    assert not engine.dead
    assert seqs[1].finish_reason == "error" and "'a2' could not be read: RuntimeError: shape" in seqs[1].error
    assert seqs[0].output_ids == reference(ps[0], 4, runner.vocab, shift=1)
    assert seqs[2].output_ids == reference(ps[2], 4, runner.vocab)
