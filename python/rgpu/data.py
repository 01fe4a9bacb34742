"""Datasets that stay on the server (rgpu-opserver --files-dir): batches are built there.

* ``RemoteArray(path, dtype, shape)``: a file of the files area as an array, as
  ``numpy.memmap`` makes one of a local file (nanoGPT's ``train.bin`` of ``uint16`` tokens is
  the model case). Indexing it gives rgpu tensors built on the server: an integer or a slice
  reads those rows; an integer tensor (CPU or rgpu) of any shape gathers its rows, so a
  ``get_batch`` that picks random windows sends only the indices, or nothing when they are
  drawn on rgpu::

      data = rgpu.data.RemoteArray("data/train.bin", torch.uint16)
      ix = torch.randint(len(data) - block, (batch,), device="rgpu")
      x = data[ix[:, None] + torch.arange(block, device="rgpu")].long()

* ``ShardDataset(directory)``: a map-style Dataset whose items are the shards of a remote
  directory (``.pt``, ``.safetensors``, ``.npy``), each read on the server.
"""

import ast
import math

import torch

from . import _C
from .remote import RemotePath, _rgpu_device, load_safetensors

__all__ = ["RemoteArray", "ShardDataset"]


def _dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    import numpy

    return torch.from_numpy(numpy.zeros(0, dtype=numpy.dtype(dtype))).dtype


class RemoteArray:
    """The file `path` of the files area as an array of `dtype` and `shape` from byte `offset`
    (default shape: one dimension, as many elements as the file holds)."""

    def __init__(self, path, dtype, shape=None, offset=0, device=None):
        self.path = RemotePath(path)
        self.dtype = _dtype(dtype)
        self.offset = int(offset)
        self.device = _rgpu_device(device)
        entries = self.path.ls()
        if len(entries) != 1 or entries[0].is_dir or entries[0].name != self.path.name:
            raise IsADirectoryError(f"{self.path!r} is a directory")
        size = entries[0].size
        item = torch.empty(0, dtype=self.dtype).element_size()
        if shape is None:
            shape = ((size - self.offset) // item,)
        self.shape = torch.Size(int(s) for s in (shape if isinstance(shape, (tuple, list))
                                                 else (shape,)))
        need = self.offset + math.prod(self.shape) * item
        if not self.shape or need > size:
            raise ValueError(f"{self.path!r} has {size} bytes: too few for {tuple(self.shape)} "
                             f"elements of {self.dtype} from byte {self.offset}")
        self._row = math.prod(self.shape[1:]) * item

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"RemoteArray({self.path!r}, {self.dtype}, {tuple(self.shape)})"

    def _rows(self, start, count):
        shape = (count,) + tuple(self.shape[1:])
        strides = torch.empty(shape, dtype=self.dtype, device="meta").stride()
        return _C.files_tensor(self.path.path, self.offset + start * self._row, self.dtype,
                               list(shape), list(strides), self.device.index)

    def __getitem__(self, index):
        if isinstance(index, int):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"index {index} is out of bounds for {n} rows")
            return self._rows(index % n, 1)[0]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[torch.arange(start, stop, step)]
            return self._rows(start, max(0, stop - start))
        if not isinstance(index, torch.Tensor):
            index = torch.as_tensor(index)
        if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise TypeError(f"{self!r} is indexed by integers, not {index.dtype}")
        if index.device.type != "rgpu":
            index = index.to(self.device)  # the indices are all that cross the link
        return _C.files_gather(self.path.path, self.offset, self.dtype, len(self),
                               list(self.shape[1:]), index, self.device.index)


class ShardDataset(torch.utils.data.Dataset):
    """The shards of remote directory `path` (``.pt``, ``.safetensors``, ``.npy``, by name),
    item i being shard i read on the server: what ``torch.load``, safetensors' ``load_file``
    or ``numpy.load`` gives of it, with its tensors on rgpu."""

    SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")

    def __init__(self, path, device=None):
        self.path = RemotePath(path)
        self.device = _rgpu_device(device)
        self.shards = [e.name for e in self.path.ls()
                       if not e.is_dir and e.name.endswith(self.SUFFIXES)]

    def __len__(self):
        return len(self.shards)

    def __getitem__(self, i):
        shard = self.path / self.shards[i]
        if shard.name.endswith(".safetensors"):
            return load_safetensors(shard, self.device)
        if shard.name.endswith(".npy"):
            return load_npy(shard, self.device)
        return torch.load(shard, map_location=self.device)


def load_npy(path, device=None):
    """A remote ``.npy`` file as an rgpu tensor (read on the server)."""
    head = _C.files_read(path.path, 0, 16)
    if head[:6] != b"\x93NUMPY":
        raise ValueError(f"{path!r} is not a .npy file")
    major = head[6]
    size_bytes = 2 if major == 1 else 4
    length = int.from_bytes(head[8:8 + size_bytes], "little")
    start = 8 + size_bytes
    header = ast.literal_eval(_C.files_read(path.path, start, length).decode("latin1"))
    import numpy

    if numpy.dtype(header["descr"]).byteorder == ">":
        raise NotImplementedError(f"{path!r} holds big-endian {header['descr']}")
    dtype = _dtype(header["descr"])
    shape = tuple(header["shape"])
    order = "F" if header["fortran_order"] else "C"
    meta = torch.empty(shape[::-1] if order == "F" else shape, dtype=dtype, device="meta")
    if order == "F":
        meta = meta.permute(*reversed(range(len(shape))))
    return _C.files_tensor(path.path, start + length, dtype, list(shape), list(meta.stride()),
                           _rgpu_device(device).index)
