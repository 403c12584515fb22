"""What the runner asks of a layer while it loads a model (sharding/runner.py), declared instead of probed.

- `Loadable`: a module that reads its own tensors of the checkpoint: `expected()` names them with their full shapes
  (the whole-checkpoint check), `load(ckpt)` reads this rank's block of them. `tied`: its weight is another module's
  (a tied LM head), so it reads nothing of its own.
- `Packable`: a loadable module whose weight the runner then transforms in place: `quantize(mode, group)` under
  --quantization, `prepack()` once every weight is loaded (a layout for the CPU kernels). Every linear is one.
- `ReadElsewhere`: a module some of whose checkpoint tensors only other ranks of the group read (a MoE layer's other
  experts under expert parallelism): `elsewhere` names them, so the whole-checkpoint check does not call them
  unexpected. A structural check (runtime_checkable): only the MoE layer has it.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from loaders.checkpoint import Checkpoint


class Loadable(nn.Module, metaclass=ABCMeta):
    tied: bool = False  # its weight is another module's: nothing of its own to read (counted once in the progress)

    @abstractmethod
    def expected(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors this module reads, name -> full shape."""

    @abstractmethod
    def load(self, ckpt: Checkpoint) -> None:
        """Read this rank's block of them into the module's parameters."""


class Packable(Loadable):
    @abstractmethod
    def quantize(self, mode: str, group: int) -> None:
        """Replace the weight by its weight-only quantized form (sharding/layers/quant.py), where the mode applies."""

    @abstractmethod
    def prepack(self) -> None:
        """Lay the weight out for the CPU kernels (sharding/cpu/kernels.py); called once, after every load."""


@runtime_checkable
class ReadElsewhere(Protocol):
    elsewhere: set[str]  # checkpoint tensors other ranks of the group read, this rank does not
