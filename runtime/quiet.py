"""Known, harmless messages that third-party code printed on every start, silenced at their source.

`import runtime` calls `silence_known_noise()`, so it is in place before anything of the runtime
imports torchao (the QLoRA base, the low-bit AdamW slots import it after `runtime`) or slices a
mesh. Each filter matches one message of one emitter, so any other warning still shows:

- torchao's logger, "Failed to load .../torchao/_C_*.so: ...", once per CUDA kernel library at
  `import torchao`, and only when torch is a CPU-only build: those libraries link
  `libtorch_cuda.so`, which such a build does not have, so they can never load there and
  nothing that runs on CPU needs them. Under a CUDA build the message still shows (there it
  means a broken install).
- torch's `torch.utils._pytree` logger, "<enum '...'> is an Enum subclass and is now natively
  supported by torch.compile ... register_constant() on Enum subclasses is deprecated", for the
  Enums of torchao's own modules only (torchao registers them at import; torch 2.13 needs no
  registration). Another library's or the user's Enum still warns.
- DeviceMesh's UserWarning "Slicing a flattened dim from root mesh will be deprecated in PT
  2.11", raised when a script slices `mesh["dp"]` (or "dp_cp", "dp_shard_cp"), the flattened
  dims `runtime.parallel.build_mesh` registers. Slicing them still works in torch 2.13; the
  alternative it asks for (keeping each flattened mesh object) would change every script's mesh
  lookups and the 2-D HSDP x CP slice has no such object.
"""

from __future__ import annotations

import logging
import re
import warnings

import torch

_TORCHAO_KERNEL_LOAD = re.compile(r"Failed to load \S*/torchao/_C\S*\.so: ")
_PYTREE_ENUM = "is an Enum subclass and is now natively supported by torch.compile"
_FLATTENED_MESH_SLICE = r"Slicing a flattened dim from root mesh will be deprecated"


def _drop_torchao_kernel_load(record: logging.LogRecord) -> bool:
    """False (drop) for torchao's failed load of a CUDA kernel library under a CPU-only torch."""
    return not (torch.version.cuda is None and _TORCHAO_KERNEL_LOAD.match(record.getMessage()))


def _drop_torchao_enum_registration(record: logging.LogRecord) -> bool:
    """False (drop) for the pytree deprecation note about one of torchao's Enums."""
    if not (isinstance(record.msg, str) and _PYTREE_ENUM in record.msg and record.args):
        return True
    cls = record.args[0] if isinstance(record.args, tuple) else None
    return not getattr(cls, "__module__", "").startswith("torchao.")


def silence_known_noise() -> None:
    """Install the filters this module's docstring lists (idempotent: each is added once)."""
    torchao_log = logging.getLogger("torchao")  # the logger torchao/__init__.py will use
    if _drop_torchao_kernel_load not in torchao_log.filters:
        torchao_log.addFilter(_drop_torchao_kernel_load)
    pytree_log = logging.getLogger("torch.utils._pytree")
    if _drop_torchao_enum_registration not in pytree_log.filters:
        pytree_log.addFilter(_drop_torchao_enum_registration)
    warnings.filterwarnings(
        "ignore",
        message=_FLATTENED_MESH_SLICE,
        category=UserWarning,
        module=r"torch\.distributed\.device_mesh",
    )
