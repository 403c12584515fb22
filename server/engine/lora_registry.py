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
- **runtime loads** (server/api/app.py, behind TPSERVE_ALLOW_RUNTIME_LORA_UPDATING): only from folders inside
  `--lora-root` (symlinks resolved, the adapter's files too; no root: refused), at most `--max-runtime-loras` per API
  key, and unloaded only by the key that loaded them or `--lora-admin-key` (`--lora-modules` adapters: by the admin
  key only). Without --api-key there is one caller, who may do everything.
- **the ranks' reports.** Each rank reports how it read its part of a load (sharding/executor.py: lora_reports). An
  adapter is used on a replica once all of that replica's ranks reported reading it; a rank that could not read it
  fails that load there (the request that needed it gets the error, the slot is emptied on that replica), and the
  replica keeps serving.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from loaders import envs
from loaders.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterInfo, LoraError, check_against_base, read_adapter
from loaders.checkpoint import Checkpoint
from sharding.layers.lora import supports_lora
from sharding.models import model_class
from server.defaults import MAX_RUNTIME_LORAS  # (in a light module: the CLI shows it)

if TYPE_CHECKING:
    from server.engine.replicas import Replicas
    from server.engine.request import Sequence

logger = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = envs.ALLOW_RUNTIME_LORA_UPDATING.name  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


def runtime_updates_allowed() -> bool:
    return envs.ALLOW_RUNTIME_LORA_UPDATING.get()


class LoraRefused(ValueError):
    """A runtime load or unload turned down: its message, HTTP status, the request field it is about and a code."""

    def __init__(self, message: str, status: int = 400, param: str | None = "lora_path", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


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
    runtime: bool = False  # loaded through POST /v1/load_lora_adapter (not --lora-modules)
    owner: str | None = None  # runtime: who loaded it (server/api/state.py ServerState.owner: its API key's hash)

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
    def __init__(self, model_folder: str, served_name: str, max_loras: int, max_cpu_loras: int, max_rank: int,
                 root: str | None = None, max_runtime: int = MAX_RUNTIME_LORAS, admin_key: str | None = None):
        self.model_folder, self.served_name = model_folder, served_name
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.root = os.path.realpath(root) if root else None  # --lora-root: runtime loads only from inside it
        self.max_runtime = max_runtime  # --max-runtime-loras, per API key
        self.admin_key = admin_key  # --lora-admin-key: may unload any adapter
        self.by_name: dict[str, Adapter] = {}
        self.slots: list[Adapter | None] = [None] * (max_cpu_loras + 1)  # index 0 unused: the base model
        self._lock = threading.Lock()  # names are changed from HTTP threads, slots only on the engine thread

    # ---- names (any thread) ------------------------------------------------------------------------------------
    def check(self, name: str, path: str, base_model_name: str | None = None, runtime: bool = False) -> Adapter:
        """Rank 0's check of an adapter before anything reaches the ranks; raises ValueError naming the problem.
        `runtime` (POST /v1/load_lora_adapter): the folder must be inside --lora-root (runtime_path)."""
        from loaders.gguf_file import open_checkpoint

        if not name or name == self.served_name:
            raise LoraRefused(f"the adapter name {name!r} is empty or the base model's own name", param="lora_name")
        if runtime:
            path = self.runtime_path(path)
        if "://" in path or not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a local folder (adapters are read from local PEFT folders only)")
        with open_checkpoint(self.model_folder) as base:  # (a quantized folder's linears under their float names)
            names = [self.served_name] + ([base_model_name] if base_model_name else [])
            info = validate_adapter(path, base, self.max_rank, names, check_name=base_model_name is None)
        if base_model_name is not None and base_model_name not in (self.served_name, self.model_folder,
                                                                   os.path.basename(self.model_folder.rstrip("/"))):
            raise ValueError(f"base_model_name {base_model_name!r} is not the served model ({self.served_name!r})")
        return Adapter(name, os.path.abspath(path), base_model_name, info)

    def runtime_path(self, path: str) -> str:
        """A runtime lora_path as the folder to read: inside --lora-root once every symlink is resolved, and so are
        its adapter_config.json and adapter_model.safetensors (a relative path is taken from the root). Without
        --lora-root nothing is loaded at runtime. Raises LoraRefused."""
        if self.root is None:
            raise LoraRefused("runtime LoRA loading needs --lora-root: this server was started without the folder "
                              "runtime adapters may be loaded from", code="lora_root_unset")
        if "://" in path:
            raise LoraRefused(f"{path!r} is not a local folder (adapters are read from local PEFT folders only)")
        try:
            real = os.path.realpath(os.path.join(self.root, path))
            files = [real] + [os.path.realpath(os.path.join(real, f)) for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
        except (ValueError, OSError) as e:  # an embedded NUL byte
            raise LoraRefused(f"lora_path {path[:200]!r} cannot be resolved: {e}") from None
        if not all(os.path.commonpath([self.root, f]) == self.root for f in files):
            raise LoraRefused(f"lora_path {path!r} is outside the server's --lora-root (symlinks resolved)",
                              code="lora_path_outside_root")
        if not os.path.isdir(real):
            raise LoraRefused(f"{path!r} is not a local folder under --lora-root (adapters are read from local PEFT "
                              "folders only)")
        return real

    def register(self, adapter: Adapter, owner: str | None = None, runtime: bool = False) -> None:
        """Add the name (LoraRefused if taken); `runtime`: loaded by `owner`, within its --max-runtime-loras."""
        with self._lock:
            if adapter.name in self.by_name:
                raise LoraRefused(f"the LoRA adapter {adapter.name!r} is already loaded", param="lora_name")
            if runtime:
                self._room(owner)
            adapter.runtime, adapter.owner = runtime, owner
            self.by_name[adapter.name] = adapter

    def room_for(self, owner: str | None) -> None:
        """LoraRefused if `owner` holds --max-runtime-loras runtime adapters already (checked again at register)."""
        with self._lock:
            self._room(owner)

    def _room(self, owner: str | None) -> None:
        held = sum(1 for a in self.by_name.values() if a.runtime and a.owner == owner)
        if held >= self.max_runtime:
            who = "this API key has" if owner is not None else "this server has"
            raise LoraRefused(f"{who} {held} LoRA adapters loaded at runtime, the most --max-runtime-loras allows "
                              f"({self.max_runtime}); unload one first", param=None, code="lora_limit_reached")

    def is_admin(self, token: str | None) -> bool:
        return bool(self.admin_key) and token is not None and hmac.compare_digest(token.encode(),
                                                                                  self.admin_key.encode())

    def retire(self, name: str, owner: str | None = None, admin: bool = True) -> Adapter:
        """Forget the name (KeyError if unknown; LoraRefused, 403, unless `admin` or `owner` loaded it at runtime);
        sequences already holding the adapter keep it."""
        with self._lock:
            adapter = self.by_name.get(name)
            if adapter is None:
                raise KeyError(name)
            if not admin and not (adapter.runtime and adapter.owner == owner):
                whose = "another API key" if adapter.runtime else "the server's --lora-modules"
                raise LoraRefused(f"the LoRA adapter {name!r} was loaded by {whose}; only that key or the "
                                  "--lora-admin-key may unload it", 403, "lora_name", "lora_not_owner")
            del self.by_name[name]
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


PENDING = "pending"  # LoraSlots._settle: some rank of the replica has not reported reading the adapter yet


class LoraSlots:
    """The engine's side of the slots, on the engine thread: whether a waiting sequence may join its lane's batch
    now (reading its adapter into a slot on rank 0 and every live replica first, and waiting for the replica's ranks
    to report they read it), freeing a retired adapter's slot, and giving a respawned replica every adapter the
    others hold.

    A load's reports (sharding/executor.py: lora_reports) are waited for when the sequence's replica has no step in
    flight (its ranks then have nothing to do before the load); while it has, the sequence keeps its place and the
    reports are looked at again at the next schedule, by when that step has come back. A rank that could not read
    its part marks the (slot, replica) broken: the request is answered with the reason, the slot is emptied on that
    replica, and freed everywhere once no running sequence uses the adapter (the next request reads it again)."""

    def __init__(self, registry: LoraRegistry, replicas: Replicas, finish: Callable[[Sequence, str], None],
                 down_later: Callable[[int, str], None]):
        self.registry, self.replicas, self.executor = registry, replicas, replicas.executor
        self._finish = finish  # (sequence, "error"): its adapter could not be read
        self._down_later = down_later  # (replica, reason): out of rotation once this step is scheduled
        self.pending: dict[tuple[int, int], object] = {}  # (slot, replica) -> ticket of a load not all ranks reported
        self.broken: dict[tuple[int, int], str] = {}  # (slot, replica) -> why a rank of it could not read the slot's
        # whether a replica is being taken down (its ranks' reports will not come): set by the server (the supervisor)
        self.gone: Callable[[int], bool] = lambda replica: False

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """No more than --max-loras adapters in the step, and its adapter in a slot (read into one now if needed)
        that every rank of its replica has reported reading."""
        adapter = seq.lora
        active = {s.lora for s in running if s.lora is not None}
        if adapter not in active and len(active) >= self.registry.max_loras:
            return False
        try:
            slot = self.registry.slot_for(adapter, self.in_use, self._load)
        except Exception as e:  # noqa: BLE001 - any error reading it on rank 0 (its folder changed since the
            # check, say) fails that load, not the engine
            why = str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
            self._fail(seq, f"the LoRA adapter {adapter.name!r} could not be read: {why}")
            return False
        if not slot:
            return False
        why = self._settle(slot, self.replicas.lanes[seq.lane].replica, self._down_later)
        if why is None:
            return True
        if why is not PENDING:
            if not self.in_use(adapter):
                self._free(slot, self._down_later)  # the next request reads it again, on every rank
            self._fail(seq, why)
        return False

    def _fail(self, seq: Sequence, why: str) -> None:
        logger.error("%s", why)
        seq.error = why
        self._finish(seq, "error")

    def in_use(self, adapter: Adapter, waiting: bool = False) -> bool:
        return any(s.lora is adapter for lane in self.replicas.lanes
                   for s in (list(lane.scheduler.running) + (list(lane.scheduler.waiting) if waiting else [])))

    def _load(self, slot: int, path: str) -> None:
        """Rank 0's part first (raises with nothing sent), then every live replica's ranks (their reports are
        awaited in _settle). This runs inside a lane's schedule(): a replica found dead here is taken down between
        steps, not under the scheduler's feet."""
        self._forget(slot)
        self.executor.lora_load(slot, path, [], True)
        for replica in self.replicas.live():
            ticket, ok = self.replicas.call(replica, self.executor.lora_load, slot, path, [replica], False,
                                            down=self._down_later)
            if ok and ticket is not None:
                self.pending[(slot, replica)] = ticket

    def _settle(self, slot: int, replica: int, down=None) -> str | None:
        """None once every rank of `replica` has read the adapter in `slot`; PENDING while some has not reported
        (and the replica has a step in flight, or is being taken down); else why it cannot be used there."""
        ticket = self.pending.get((slot, replica))
        if ticket is not None:
            idle = not any(lane.busy for lane in self.replicas.lanes if lane.replica == replica)
            failed, ok = self.replicas.call(replica, self.executor.lora_reports, ticket, idle,
                                            lambda: self.gone(replica), down=down)
            if not ok or failed is None:
                return PENDING
            del self.pending[(slot, replica)]
            if failed:
                rank, error = min(failed.items())
                adapter = self.registry.slots[slot]
                self.broken[(slot, replica)] = (f"the LoRA adapter {adapter.name if adapter else '?'!r} could not be "
                                                f"read on rank {rank}: {error}")
                self.replicas.call(replica, self.executor.lora_unload, slot, [replica], down=down)
        return self.broken.get((slot, replica))

    def _forget(self, slot: int, replica: int | None = None) -> None:
        for marks in (self.pending, self.broken):
            for key in [k for k in marks if k[0] == slot and replica in (None, k[1])]:
                del marks[key]

    def _free(self, slot: int, down=None) -> None:
        """Empty `slot` on rank 0 and every live replica's ranks; its adapter is read again when next needed."""
        self.executor.lora_unload(slot, [])
        for replica in self.replicas.live():
            self.replicas.call(replica, self.executor.lora_unload, slot, [replica], down=down)
        adapter = self.registry.slots[slot]
        if adapter is not None:
            adapter.slot = 0
        self.registry.slots[slot] = None
        self._forget(slot)

    def retire(self, adapter: Adapter) -> None:
        """An unloaded adapter's slot is freed now if no sequence runs or waits with it, else when it is next
        needed (its sequences in flight finish with it)."""
        if adapter.slot and not self.in_use(adapter, waiting=True):
            self._free(adapter.slot)

    def reload(self, replica: int) -> None:
        """A respawned replica's ranks read every adapter the others hold, before it serves. Their reports are
        looked at when a sequence first needs each adapter there (admit: inside a step, where the watchdog sees a
        rank that hangs); one its ranks could not read is failed then, as any load."""
        for slot, adapter in enumerate(self.registry.slots):
            if adapter is not None and replica not in self.replicas.down:
                self._forget(slot, replica)
                ticket, ok = self.replicas.call(replica, self.executor.lora_load, slot, adapter.path, [replica], False)
                if ok and ticket is not None:
                    self.pending[(slot, replica)] = ticket


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
