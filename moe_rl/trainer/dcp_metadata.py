"""torch DCP's checkpoint metadata (``.metadata``) read without running code from it.

megatron-core's ``dist_checkpointing.load`` reads a step's ``trainer/dist/.metadata`` through
torch's ``FileSystemReader.read_metadata``, a plain ``pickle.load``: a crafted file would run
whatever it names. :func:`install` replaces that read with an unpickler that admits only the classes
DCP's metadata is made of (the ``torch.distributed.checkpoint`` metadata and plan records,
``torch.Size``, torch dtypes and layouts, a path) and refuses anything else, naming the file and the
global, before any of it is called. Every other file of a checkpoint is already read without pickle
code (safetensors, or ``torch.load(weights_only=True)``)."""
from __future__ import annotations

import os
import pickle

import torch

_DCP = "torch.distributed.checkpoint"
ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),   # StorageMeta.checkpoint_id
    (f"{_DCP}.filesystem", "_StorageInfo"),
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
}


class UnsafeMetadata(pickle.UnpicklingError):
    """A checkpoint metadata file that names something other than DCP's metadata records."""


class MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata records and torch dtypes only."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeMetadata(f"{self.path}: refused to load checkpoint metadata naming "
                             f"{module}.{name} (only torch DCP's metadata records are read); "
                             f"the file is not one moe_rl wrote")


def read_metadata(path: str):
    """The DCP ``Metadata`` stored at ``path``, through :class:`MetadataUnpickler`."""
    with open(path, "rb") as fh:
        return MetadataUnpickler(fh, path).load()


def check(checkpoint_dir: str) -> None:
    """Read ``checkpoint_dir``'s ``.metadata`` through the allow-list before torch does, so a
    crafted file is refused here (UnsafeMetadata naming it), not inside DCP's load (which logs a
    traceback and wraps the error)."""
    read_metadata(os.path.join(checkpoint_dir, ".metadata"))


def install() -> None:
    """Make torch's ``FileSystemReader.read_metadata`` (what megatron's ``dist_checkpointing``
    calls) read through :func:`read_metadata`. Idempotent."""
    from torch.distributed.checkpoint import filesystem
    reader = filesystem.FileSystemReader
    if getattr(reader.read_metadata, "moe_rl_safe", False):
        return
    original = reader.read_metadata

    def safe_read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = read_metadata(str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = filesystem.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
    safe_read_metadata.moe_rl_safe = True
    safe_read_metadata.__wrapped__ = original
    reader.read_metadata = safe_read_metadata
