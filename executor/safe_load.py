"""Loading a run folder's files as data only: no pickle in a checkpoint can run code when resumed.

A checkpoint (`trainplan.executor.checkpoint`) holds three kinds of pickle: `optimizer.pt` (ZeRO-1)
and `rankN.pt` (RNG states), written by `torch.save`; DCP's `.metadata` (`pickle.dump` of a
`torch.distributed.checkpoint.metadata.Metadata`); and DCP's non-tensor items (param groups, a
step count), each a `torch.save` inside a `.distcp` file. torch's defaults unpickle the last two
with no restriction (`FileSystemReader.read_metadata` calls `pickle.load`,
`DefaultLoadPlanner.load_bytes` calls `torch.load(weights_only=False)`), and so did
`optimizer.pt`'s load: a crafted file's `__reduce__` would run whatever it names (torch's own
warning, https://pytorch.org/docs/stable/generated/torch.load.html). Here every one is read with
an allow-list:

- `load_tensors`: `torch.load(weights_only=True)` (tensors, plain containers, numbers, strings)
  plus the low-bit optimizers' state classes (`optimizer_state_classes`: torchao's
  `OptimState4bit`/`OptimState8bit`; bitsandbytes keeps plain tensors and dicts), allowed for
  that load only (`torch.serialization.safe_globals`).
- `dcp_load`: `torch.distributed.checkpoint.load` with a reader whose metadata unpickler accepts
  only `METADATA_GLOBALS` (DCP's metadata dataclasses, `torch.Size`, dtypes, paths) and a planner
  whose non-tensor items load with `weights_only=True`.

Anything else is an `UnsafeFileError` naming the file and the refused global, before the global
is called. `torch.distributed.checkpoint` (about a second to import) is imported when loading.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import torch

from trainplan.errors import TrainplanError, UnsafeFileError

METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}
"""The globals a DCP `.metadata` pickle may name (torch 2.13's `Metadata` and what it holds), by
module; a `torch` dtype (`torch.float32`, ...) is allowed too. Anything else is refused."""

WHY_REFUSED = "a pickle naming it would call it when loaded: a crafted file runs code that way"


def optimizer_state_classes() -> tuple[type, ...]:
    """The low-bit optimizers' state classes a checkpoint may hold: torchao's `OptimState4bit` and
    `OptimState8bit` once `torchao.optim` is imported (a run with 4-bit AdamW imports it before
    loading), else none. bitsandbytes' 8-bit AdamW state is plain tensors and dicts."""
    if "torchao.optim" not in sys.modules:
        return ()
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    return (OptimState4bit, OptimState8bit)


def allowing_optimizer_states() -> contextlib.AbstractContextManager:
    """A context in which `torch.load(weights_only=True)` accepts `optimizer_state_classes`: those
    not yet allowed are added (`torch.serialization.safe_globals`) and removed on exit; those
    already allowed (torchao registers its own on import) stay, since the context manager removes
    what it added whether or not it was there before."""
    allowed = torch.serialization.get_safe_globals()
    return torch.serialization.safe_globals([c for c in optimizer_state_classes() if c not in allowed])


def load_tensors(path: str | Path, *, map_location: Any = None) -> Any:
    """What `torch.save` wrote to `path`, loaded with `weights_only=True` and the
    `optimizer_state_classes` allowed for this load.

    Raises:
        UnsafeFileError: the pickle names any other global (the message names the file and it).
    """
    with allowing_optimizer_states():
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeFileError(_refusal(path, e)) from None


def _refusal(path: str | Path, e: BaseException) -> str:
    text = " ".join(str(e).split())
    # torch's messages: "Unsupported global: GLOBAL x.y was not an allowed global", "unsupported GLOBAL os.system
    # whose module os is blocked"; anything else (an opcode torch refuses) is quoted
    found = re.search(r"GLOBAL ([\w.]+)", text)
    name = found.group(1) if found else f"what the weights-only unpickler refuses ({text[:160]})"
    return (f"refusing to load {str(path)!r}: it names {name}, which is not a tensor, plain data or a class a "
            f"trainplan checkpoint holds ({WHY_REFUSED}); resume or export only run folders you or trainplan made")


class _MetadataUnpickler(pickle.Unpickler):
    """A pickle.Unpickler that finds only `METADATA_GLOBALS` and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name} was not an allowed global")


def read_metadata(checkpoint: str | Path):
    """The `Metadata` of DCP checkpoint folder `checkpoint` (its `.metadata` file), unpickled with
    `METADATA_GLOBALS` only.

    Raises:
        UnsafeFileError: the file names another global.
        TrainplanError: the file is missing or not a pickle (the message names it)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return _reader_class(FileSystemReader)(str(checkpoint)).read_metadata()


def _read_restricted(path: Path):
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TrainplanError(f"checkpoint {str(path.parent)!r} has no readable {path.name} ({e.strerror}): it is "
                             "incomplete; resume from a complete one or start the run again") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        if "Unsupported global" in str(e):
            raise UnsafeFileError(_refusal(path, e)) from None
        raise UnsafeFileError(f"{str(path)!r} is not a DCP metadata pickle ({e}); the checkpoint is damaged: "
                              "resume from another run folder or start the run again") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeFileError(f"{str(path)!r} holds a {type(metadata).__name__}, not a DCP Metadata; the checkpoint "
                              "is damaged: start the run again")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _reader_class(base: type) -> type:
    """`FileSystemReader` whose `read_metadata` unpickles with the allow-list (as torch's does:
    `.metadata`, or `__RANK.metadata` when asked for a rank's, with the reader's `load_id` set)."""

    class RestrictedReader(base):
        def __init__(self, checkpoint: str) -> None:
            super().__init__(checkpoint)
            self.checkpoint_dir = Path(checkpoint)

        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            metadata = _read_restricted(self.checkpoint_dir / name)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return RestrictedReader


def _planner_class(base: type) -> type:
    """`DefaultLoadPlanner` whose non-tensor items are first loaded with `load_tensors`'
    allow-list; what passes is saved again and handed to torch's own `load_bytes`, which then
    unpickles only what this process wrote."""

    class RestrictedPlanner(base):
        checkpoint = ""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            with allowing_optimizer_states():
                try:
                    obj = torch.load(value, weights_only=True)
                except pickle.UnpicklingError as e:
                    raise UnsafeFileError(_refusal(f"{self.checkpoint} (item {read_item.dest_index.fqn})",
                                                   e)) from None
            checked = io.BytesIO()
            torch.save(obj, checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return RestrictedPlanner


def dcp_load(state: dict, checkpoint: str | Path) -> None:
    """`torch.distributed.checkpoint.load(state, checkpoint_id=checkpoint)` (in place, every rank
    its shards) with the metadata and the non-tensor items read through the allow-lists.

    Raises:
        UnsafeFileError: a pickle in the checkpoint names a global outside them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    _read_restricted(Path(checkpoint) / ".metadata")  # refused here in one line (DCP would wrap the error)
    planner = _planner_class(DefaultLoadPlanner)()
    planner.checkpoint = str(checkpoint)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with allowing_optimizer_states():  # DCP reads tensors with weights_only=True: torchao's states among them
            dcp.load(state, storage_reader=_reader_class(FileSystemReader)(str(checkpoint)), planner=planner)
    except CheckpointException as e:  # DCP gathers each rank's exception into one (a BaseException)
        refused = next((exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeFileError)), None)
        if refused is not None:
            raise UnsafeFileError(str(refused)) from None
        raise
