"""LoRA adapters on rank 0: which adapters the server knows by name, which one is in which slot, and who may use them.

The ranks hold `--max-cpu-loras` slots of adapter weights each (sharding/layers/lora.py). Here, on rank 0:
- **names.** `--lora-modules` and `POST /v1/load_lora_adapter` register an adapter under a name once rank 0 has
  checked its folder against the base model (headers only: validate_adapter). A request picks it by its `model`
  field. `POST /v1/unload_lora_adapter` retires the name: new requests get 404, requests already in flight finish
  with the adapter.
- **slots.** An adapter is read into a slot when a sequence that needs it is admitted (server/engine/scheduler.py: `admit`,
  on the engine thread). Rank 0 reads its part, then the step protocol tells every live replica's ranks to read
  theirs (sharding/executor.py: lora_load). When no slot is free, the least recently used adapter that no running
  sequence uses is evicted; it is read again when it is next needed. A respawned replica gets every loaded adapter
  again before it serves (LoraSlots.reload).
- **steps.** At most `--max-loras` distinct adapters run in one step (a lane's running batch). A waiting sequence
  whose adapter would exceed that, or finds no free slot, keeps its place while others go ahead.
- **the prefix cache.** An adapter's sequences start their block-hash chain from a root of their own (`cache_root`),
  so two adapters, or an adapter and the base model, never share K/V.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from loaders import envs
from loaders.adapters import AdapterInfo, LoraError, check_against_base, read_adapter
from loaders.checkpoint import Checkpoint
from sharding.layers.lora import supports_lora
from sharding.models import model_class

if TYPE_CHECKING:
    from server.engine.replicas import Replicas
    from server.engine.request import Sequence

logger = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = envs.ALLOW_RUNTIME_LORA_UPDATING.name  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


def runtime_updates_allowed() -> bool:
    return envs.ALLOW_RUNTIME_LORA_UPDATING.get()


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    base_model_name: str | None = None
    info: object = None  # its parsed adapter_config (loaders/adapters.py AdapterInfo)
    slot: int = 0  # its slot on the ranks while loaded, else 0
    last_used: float = field(default_factory=time.monotonic)
    retired: bool = False  # unloaded by name: no new requests, the ones in flight finish
    loads: int = 0  # times it was read into a slot (an evicted adapter is read again when needed)

    @property
    def cache_root(self) -> bytes:
        """The first key of its sequences' prefix-cache chains (server/engine/block_manager.py)."""
        return hashlib.sha256(f"lora\0{self.name}\0{os.path.realpath(self.path)}".encode()).digest()


def parse_lora_modules(items: list[str]) -> list[tuple[str, str, str | None]]:
    """vLLM's --lora-modules: `name=path` or JSON {"name", "path", "base_model_name"}; (name, path, base)."""
    out = []
    for item in items:
        item = item.strip()
        if item.startswith("{"):
            try:
                d = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {item!r}: not valid JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"--lora-modules {item!r}: the JSON form needs string fields \"name\" and \"path\"")
            out.append((d["name"], d["path"], d.get("base_model_name")))
        elif "=" in item:
            name, path = item.split("=", 1)
            if not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
            out.append((name, path, None))
        else:
            raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object")
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return out


class LoraRegistry:
    def __init__(self, model_folder: str, served_name: str, max_loras: int, max_cpu_loras: int, max_rank: int):
        self.model_folder, self.served_name = model_folder, served_name
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.by_name: dict[str, Adapter] = {}
        self.slots: list[Adapter | None] = [None] * (max_cpu_loras + 1)  # index 0 unused: the base model
        self._lock = threading.Lock()  # names are changed from HTTP threads, slots only on the engine thread

    # ---- names (any thread) ------------------------------------------------------------------------------------
    def check(self, name: str, path: str, base_model_name: str | None = None) -> Adapter:
        """Rank 0's check of an adapter before anything reaches the ranks; raises ValueError naming the problem."""
        from loaders.checkpoint import Checkpoint

        if not name or name == self.served_name:
            raise ValueError(f"the adapter name {name!r} is empty or the base model's own name")
        if "://" in path or not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a local folder (adapters are read from local PEFT folders only)")
        with Checkpoint(self.model_folder) as base:
            names = [self.served_name] + ([base_model_name] if base_model_name else [])
            info = validate_adapter(path, base, self.max_rank, names, check_name=base_model_name is None)
        if base_model_name is not None and base_model_name not in (self.served_name, self.model_folder,
                                                                   os.path.basename(self.model_folder.rstrip("/"))):
            raise ValueError(f"base_model_name {base_model_name!r} is not the served model ({self.served_name!r})")
        return Adapter(name, os.path.abspath(path), base_model_name, info)

    def register(self, adapter: Adapter) -> None:
        with self._lock:
            if adapter.name in self.by_name:
                raise ValueError(f"the LoRA adapter {adapter.name!r} is already loaded")
            self.by_name[adapter.name] = adapter

    def retire(self, name: str) -> Adapter:
        """Forget the name (KeyError if unknown); sequences already holding the adapter keep it."""
        with self._lock:
            adapter = self.by_name.pop(name)
        adapter.retired = True
        return adapter

    def resolve(self, name: str | None) -> Adapter | None:
        return self.by_name.get(name) if name else None

    def models(self) -> list[Adapter]:
        with self._lock:
            return list(self.by_name.values())

    @property
    def loaded(self) -> int:
        return sum(1 for a in self.slots[1:] if a is not None)

    # ---- slots (the engine thread) -----------------------------------------------------------------------------
    def slot_for(self, adapter: Adapter, in_use, load) -> int:
        """The adapter's slot, reading it into a free one (or the least recently used one no running sequence
        uses: `in_use(adapter)`) first with `load(slot, path)`; 0 when every slot is busy."""
        adapter.last_used = time.monotonic()
        if adapter.slot:
            return adapter.slot
        free = [i for i in range(1, len(self.slots)) if self.slots[i] is None]
        if not free:
            idle = [i for i in range(1, len(self.slots)) if not in_use(self.slots[i])]
            if not idle:
                return 0
            victim = min(idle, key=lambda i: (not self.slots[i].retired, self.slots[i].last_used))
            logger.info("LoRA slot %d: %s evicted for %s", victim, self.slots[victim].name, adapter.name)
            self.slots[victim].slot = 0
            self.slots[victim] = None
            free = [victim]
        slot = free[0]
        load(slot, adapter.path)  # raises when rank 0 cannot read it: nothing was sent to the other ranks
        self.slots[slot], adapter.slot = adapter, slot
        adapter.loads += 1
        return slot


class LoraSlots:
    """The engine's side of the slots, on the engine thread: whether a waiting sequence may join its lane's batch
    now (reading its adapter into a slot on rank 0 and every live replica first), freeing a retired adapter's slot,
    and giving a respawned replica every adapter the others hold."""

    def __init__(self, registry: LoraRegistry, replicas: Replicas, finish: Callable[[Sequence, str], None],
                 down_later: Callable[[int, str], None]):
        self.registry, self.replicas, self.executor = registry, replicas, replicas.executor
        self._finish = finish  # (sequence, "error"): its adapter could not be read
        self._down_later = down_later  # (replica, reason): out of rotation once this step is scheduled

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """No more than --max-loras adapters in the step, and its adapter in a slot (read into one now if needed)."""
        adapter = seq.lora
        active = {s.lora for s in running if s.lora is not None}
        if adapter not in active and len(active) >= self.registry.max_loras:
            return False
        try:
            return self.registry.slot_for(adapter, self.in_use, self._load) > 0
        except (OSError, ValueError) as e:  # rank 0 could not read it (its folder changed since the check)
            logger.error("LoRA adapter %s could not be read: %s", adapter.name, e)
            self._finish(seq, "error")
            return False

    def in_use(self, adapter: Adapter, waiting: bool = False) -> bool:
        return any(s.lora is adapter for lane in self.replicas.lanes
                   for s in (list(lane.scheduler.running) + (list(lane.scheduler.waiting) if waiting else [])))

    def _load(self, slot: int, path: str) -> None:
        """Rank 0's part first (raises with nothing sent), then every live replica's ranks. This runs inside a
        lane's schedule(): a replica found dead here is taken down between steps, not under the scheduler's feet."""
        self.executor.lora_load(slot, path, [], True)
        for replica in self.replicas.live():
            self.replicas.call(replica, self.executor.lora_load, slot, path, [replica], False, down=self._down_later)

    def retire(self, adapter: Adapter) -> None:
        """An unloaded adapter's slot is freed now if no sequence runs or waits with it, else when it is next
        needed (its sequences in flight finish with it)."""
        if adapter.slot and not self.in_use(adapter, waiting=True):
            slot = adapter.slot
            self.executor.lora_unload(slot, [])
            for replica in self.replicas.live():
                self.replicas.call(replica, self.executor.lora_unload, slot, [replica])
            self.registry.slots[slot], adapter.slot = None, 0

    def reload(self, replica: int) -> None:
        """A respawned replica's ranks read every adapter the others hold, before it serves."""
        for slot, adapter in enumerate(self.registry.slots):
            if adapter is not None and replica not in self.replicas.down:
                self.replicas.call(replica, self.executor.lora_load, slot, adapter.path, [replica], False)


def validate_adapter(folder: str, base: Checkpoint, max_rank: int, base_names: tuple[str, ...] | list[str] = (),
                     check_name: bool = True) -> AdapterInfo:
    """Rank 0's check of an adapter folder against the served base checkpoint (headers only, no tensor data, no
    other rank involved). Raises LoraError (a ValueError) naming the problem; returns the parsed adapter. `base_names`:
    the names the base model goes by (its folder, served model name, config _name_or_path), see check_against_base."""
    arch = base.architecture
    if not supports_lora(model_class(arch)):
        raise LoraError(f"LoRA adapters are not supported for {arch} yet")
    info = read_adapter(folder)
    names = list(base_names) + [str(base.folder), base.config_dict.get("_name_or_path") or ""]
    check_against_base(info, base.tensors, max_rank, names, check_name)
    return info
