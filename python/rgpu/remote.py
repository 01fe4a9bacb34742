"""Files on the server: checkpoints, model directories and datasets that never cross the link.

``rgpu.remote("ckpt/step100.pt")`` names a file in this principal's part of the server's files
area (``rgpu-opserver --files-dir``): paths are relative to it, ``/``-separated, without ``..``.
Where a local path would go, a remote one keeps the bytes on the server:

* ``torch.save(obj, rgpu.remote(p))`` writes a standard ``torch.save`` archive there from the
  rgpu tensors the server already holds: the client sends the pickle and the list of storages,
  no tensor bytes. Each storage is tagged with the server's device (``cuda:0``), so plain
  ``torch.load`` on the server host reads it as a CUDA checkpoint.
* ``torch.load(rgpu.remote(p))`` reads any ``torch.save`` archive of the files area into rgpu
  tensors on the server, sending only the pickle to the client; tensors that shared a storage
  in the file are views of one tensor. ``map_location`` may name an rgpu device (the default:
  the current one), or another device to move the loaded tensors to.
* safetensors' ``save_file``, ``load_file`` and ``safe_open`` take remote paths (what they
  read lands on rgpu; ``load_file`` reads onto the
  current rgpu device, or the rgpu device ``device`` names: its default, "cpu", is taken to mean
  the current one, since the file is on the server), and so do Hugging Face's
  ``save_pretrained`` and ``from_pretrained`` (``rgpu._frameworks``).
* ``.open()``, ``.ls()``, ``.rm()``, ``.read_bytes()``, ``.write_bytes()`` for small files
  (configs, tokenizers), ``.upload(local)`` and ``.download(local)`` for files that start or
  end on this machine (chunked; an upload that broke off goes on where it stopped, and the
  server checks the whole file's digest before it keeps it).

A remote path is deliberately not an ``os.PathLike``: a local function handed one fails instead
of writing a local file of that name.
"""

import collections
import io
import json
import os
import pickle
import posixpath
import sys
import tempfile

import torch

from . import _C

__all__ = ["RemotePath", "remote"]

Entry = collections.namedtuple("Entry", "name size is_dir")

#: Bytes per request of a chunked read or write.
CHUNK = 64 << 20


class RemotePath:
    """A path in this principal's files area on the server."""

    __slots__ = ("path",)

    def __init__(self, path):
        path = os.fspath(path) if not isinstance(path, RemotePath) else path.path
        if not isinstance(path, str):
            raise TypeError(f"a remote path is text, not {type(path).__name__}")
        self.path = posixpath.normpath(path) if path not in ("", ".") else ""
        if self.path.startswith("/") or self.path == ".." or self.path.startswith("../"):
            raise ValueError(f"rgpu.remote({path!r}): remote paths are relative to your files "
                             f"area, and never leave it")

    def __truediv__(self, other):
        return RemotePath(posixpath.join(self.path, os.fspath(other)) if self.path
                          else os.fspath(other))

    def __eq__(self, other):
        return isinstance(other, RemotePath) and other.path == self.path

    def __hash__(self):
        return hash(("rgpu.remote", self.path))

    def __repr__(self):
        return f"rgpu.remote({self.path!r})"

    def __str__(self):
        return f"remote:{self.path}"

    @property
    def name(self):
        return posixpath.basename(self.path)

    @property
    def parent(self):
        return RemotePath(posixpath.dirname(self.path))

    def ls(self):
        """A directory's entries (``Entry(name, size, is_dir)``, sorted), or the file's own."""
        return [Entry(*e) for e in _C.files_list(self.path)]

    def exists(self):
        try:
            _C.files_list(self.path)
            return True
        except FileNotFoundError:
            return False

    def is_dir(self):
        if not self.path:
            return True
        try:
            return any(e.is_dir and e.name == self.name for e in self.parent.ls())
        except FileNotFoundError:
            return False

    def rm(self, recursive=False):
        """Removes a file, or an empty directory (any directory, with ``recursive``)."""
        if recursive and self.is_dir():
            for e in self.ls():
                (self / e.name).rm(recursive=True)
        _C.files_remove(self.path)

    def read_bytes(self):
        out = bytearray()
        while True:
            chunk = _C.files_read(self.path, len(out), CHUNK)
            out += chunk
            if len(chunk) < CHUNK:
                return bytes(out)

    def read_text(self, encoding="utf-8"):
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data):
        """Writes the file whole: it appears under its name only once all of it is written."""
        data = bytes(data)
        for at in range(0, max(len(data), 1), CHUNK):
            last = at + CHUNK >= len(data)
            _C.files_write(self.path, at, [data[at:at + CHUNK]], last, "")

    def write_text(self, text, encoding="utf-8"):
        self.write_bytes(text.encode(encoding))

    def open(self, mode="r", encoding=None):
        """A file object over the whole file: read at open, or written at close."""
        if mode in ("r", "rb"):
            raw = io.BytesIO(self.read_bytes())
            return raw if mode == "rb" else io.TextIOWrapper(raw, encoding=encoding or "utf-8")
        if mode in ("w", "wb"):
            raw = _Writer(self)
            return raw if mode == "wb" else io.TextIOWrapper(raw, encoding=encoding or "utf-8")
        raise ValueError(f"{self!r}.open: mode {mode!r} (remote files open as r, rb, w or wb)")

    def upload(self, local_path):
        """Copies a local file here, in chunks. An upload that broke off (the connection, or
        this process) goes on from what the server has; the server checks the digest of the
        whole file before it keeps it under this name."""
        import hashlib

        size = os.path.getsize(local_path)
        digest = hashlib.blake2b(digest_size=32)
        with open(local_path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                digest.update(block)
        digest = digest.hexdigest()
        partial = RemotePath(self.path + ".partial")
        try:
            done = partial.ls()[0].size if partial.exists() else 0
        except (FileNotFoundError, IsADirectoryError):
            done = 0
        if done > size:
            done = 0
        try:
            self._send(local_path, size, done, digest)
        except ValueError:
            if not done:
                raise
            self._send(local_path, size, 0, digest)  # what was there was another file's

    def _send(self, local_path, size, start, digest):
        with open(local_path, "rb") as f:
            f.seek(start)
            at = start
            while True:
                block = f.read(CHUNK)
                last = at + len(block) >= size
                _C.files_write(self.path, at, [block], last, digest if last else "")
                at += len(block)
                if last:
                    return

    def download(self, local_path):
        """Copies this file to a local one."""
        with open(local_path, "wb") as f:
            at = 0
            while True:
                chunk = _C.files_read(self.path, at, CHUNK)
                f.write(chunk)
                at += len(chunk)
                if len(chunk) < CHUNK:
                    return


class _Writer(io.RawIOBase):
    def __init__(self, path):
        self._path, self._buf = path, io.BytesIO()

    def writable(self):
        return True

    def write(self, b):
        return self._buf.write(b)

    def close(self):
        if not self.closed:
            self._path.write_bytes(self._buf.getvalue())
        super().close()


def remote(path):
    """The file or directory ``path`` of this principal's files area on the server."""
    return RemotePath(path)


def _rgpu_device(where=None):
    if where is None:
        return torch.device("rgpu", torch.rgpu.current_device())
    device = torch.device(where)
    if device.type == "rgpu" and device.index is None:
        device = torch.device("rgpu", torch.rgpu.current_device())
    return device


def _server_location(device):
    """The server's own name for rgpu device `device` ("cuda:0", "cpu")."""
    devices = _C.server_hello()["devices"]
    index = device.index or 0
    return devices[index] if index < len(devices) else devices[0]


#  torch.save / torch.load


def _remote_tensor(t):
    """What the archive holds of rgpu tensor `t`: a tensor laid out as its storage will be."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    return t if dense(t) else t.contiguous()


def save(obj, path, pickle_module=pickle, pickle_protocol=2):
    """torch.save(obj, rgpu.remote(path)): see the module's docstring."""
    from . import _transfer

    records = []
    stand_ins = {}  # a stand-in storage's _cdata -> the rgpu tensor it stands for

    class Archive:  # what torch.serialization._save writes into
        def write_record(self, name, data, nbytes):
            if isinstance(data, str):
                data = data.encode()
            if isinstance(data, (bytes, bytearray)):
                records.append((name, bytes(data)))
                return
            held = stand_ins.get(data._cdata)
            if held is not None:
                records.append((name, held))
            else:  # a CPU tensor's storage in what is saved: its bytes
                cpu = torch.empty(0, dtype=torch.uint8).set_(data)
                records.append((name, cpu.numpy().tobytes()))

    with torch.no_grad(), _transfer.saving_remote(stand_ins, _server_location):
        torch.serialization._save(obj, Archive(), pickle_module, pickle_protocol, False)
        _C.files_save_archive(path.path, records)


def load(path, map_location=None, pickle_module=None, *, weights_only=None, mmap=None,
         **pickle_load_args):
    """torch.load(rgpu.remote(path)): see the module's docstring."""
    from . import _transfer

    target = None
    if isinstance(map_location, (str, torch.device)):
        target = torch.device(map_location)
    elif map_location is not None:
        raise ValueError(f"torch.load of {path!r}: map_location may name a device for a file on "
                         f"the server, not {type(map_location).__name__}")
    device = _rgpu_device(target if target is not None and target.type == "rgpu" else None)
    if weights_only is None:
        weights_only = pickle_module is None and \
            os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in ("1", "y", "yes",
                                                                              "true")
    if weights_only and pickle_module is not None:
        raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    unpickler = torch.serialization._weights_only_unpickler if weights_only else \
        (pickle_module or pickle)
    pickle_load_args.setdefault("encoding", "utf-8")

    records = dict(_C.files_load_archive(path.path, device.index))
    if records.get("byteorder", b"little") != sys.byteorder.encode():
        raise NotImplementedError(f"torch.load of {path!r}: its tensors are "
                                  f"{records['byteorder'].decode()}-endian")
    stand_ins = {}  # a CPU stand-in storage's data_ptr -> the rgpu bytes of its record
    held = []

    class Archive:  # what torch.serialization._load reads from
        def has_record(self, name):
            return name in records

        def get_record(self, name):
            return records[name]

        def get_all_records(self):
            return list(records)

        def get_storage_from_record(self, name, nbytes, _type):
            # Never touched: its pages are never allocated.
            stand_in = torch.empty(nbytes, dtype=torch.uint8)
            held.append(stand_in)
            stand_ins[stand_in.untyped_storage().data_ptr()] = records[name]
            return stand_in

        def serialization_id(self):
            return records.get(".data/serialization_id", b"").decode()

    try:
        obj = torch.serialization._load(Archive(), lambda storage, location: storage, unpickler,
                                        **pickle_load_args)
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        raise pickle.UnpicklingError(f"torch.load of {path!r} with weights_only=True: {e}") \
            from None
    with torch.no_grad():
        obj = _transfer.map_tensors(obj, lambda t: _from_stand_in(t, stand_ins))
    if target is not None and target.type != "rgpu":
        obj = _transfer.map_tensors(obj, lambda t: t.to(target))
    return obj


def _from_stand_in(t, stand_ins):
    """The rgpu tensor CPU stand-in `t` stands for: a view of its storage's bytes."""
    if t.device.type != "cpu":
        return None
    raw = stand_ins.get(t.untyped_storage().data_ptr())
    if raw is None:
        return None
    flat = raw.view(t.dtype) if t.element_size() != 1 or t.dtype != torch.uint8 else raw
    whole = t.storage_offset() == 0 and t.is_contiguous() and t.numel() == flat.numel()
    return flat.view(t.shape) if whole else flat.as_strided(t.size(), t.stride(),
                                                            t.storage_offset())


#  safetensors

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_SAFETENSORS_NAMES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def save_safetensors(tensors, path, metadata=None):
    """safetensors.torch.save_file(tensors, rgpu.remote(path), metadata)."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise ValueError("safetensors metadata maps text to text")
    header = {"__metadata__": metadata} if metadata else {}
    parts, at = [], 0
    # As safetensors orders them: larger elements first, then by name.
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors cannot hold {name}, of {t.dtype}")
        if t.device.type != "rgpu":
            t = t.to(_rgpu_device())
        t = _remote_tensor(t).contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + nbytes]}
        at += nbytes
        if nbytes:
            parts.append(t)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    with torch.no_grad():
        _C.files_write(path.path, 0, [head] + parts, True, "")


def safetensors_header(path):
    """The header of remote safetensors file `path`, and where its data starts."""
    size = int.from_bytes(_C.files_read(path.path, 0, 8), "little")
    if size > 100 << 20:
        raise ValueError(f"{path!r} is not a safetensors file (a header of {size} bytes)")
    header = json.loads(_C.files_read(path.path, 8, size))
    return header, 8 + size


def load_safetensors(path, device=None):
    """safetensors.torch.load_file(rgpu.remote(path), device): each tensor read on the server,
    onto the current rgpu device unless `device` names another (then moved there)."""
    target = torch.device(device) if device is not None else None
    on_rgpu = target is None or target.type == "rgpu"
    f = SafeOpen(path, device=target if on_rgpu and target is not None else "cpu")
    return {name: f.get_tensor(name) if on_rgpu else f.get_tensor(name).to(target)
            for name in f.header if name != "__metadata__"}


class SafeOpen:
    """safetensors.safe_open(rgpu.remote(path), framework="pt", device=...): the file's tensors
    read on the server, onto the rgpu device `device` names (by default the current one)."""

    def __init__(self, path, framework="pt", device="cpu"):
        if framework not in ("pt", "torch"):
            raise ValueError(f"{path!r} is on the server: only framework='pt' reads it")
        self.path = path
        self.header, self.start = safetensors_header(path)
        target = torch.device(device) if str(device) != "cpu" else None
        self.device = _rgpu_device(target if target is not None and target.type == "rgpu"
                                   else None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return sorted(k for k in self.header if k != "__metadata__")

    def metadata(self):
        return self.header.get("__metadata__")

    def _read(self, name, first=0, rows=None):
        info = self.header[name]
        dtype = _SAFETENSORS_NAMES[info["dtype"]]
        shape = list(info["shape"])
        strides = list(torch.empty(shape, dtype=dtype, device="meta").stride())
        offset = self.start + info["data_offsets"][0]
        if rows is not None:  # rows [first, first + rows) of the first dimension
            offset += first * strides[0] * torch.empty(0, dtype=dtype).element_size()
            shape[0] = rows
        return _C.files_tensor(self.path.path, offset, dtype, shape, strides, self.device.index)

    def get_tensor(self, name):
        return self._read(name)

    def get_slice(self, name):
        return _Slice(self, name)


class _Slice:
    def __init__(self, file, name):
        self.file, self.name, self.info = file, name, file.header[name]

    def get_shape(self):
        return list(self.info["shape"])

    def get_dtype(self):
        return self.info["dtype"]

    def __getitem__(self, index):
        first = index[0] if isinstance(index, tuple) and index else index
        rest = index[1:] if isinstance(index, tuple) else ()
        shape = self.info["shape"]
        if isinstance(first, slice) and shape and (first.step in (None, 1)):
            start, stop, _ = first.indices(shape[0])
            t = self.file._read(self.name, start, max(0, stop - start))
            return t[(slice(None),) + tuple(rest)] if rest else t
        return self.file._read(self.name)[index]


#  Hugging Face model directories

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def fetch_small_files(path, local):
    """Copies the files of remote model directory `path` but its weights into `local`."""
    for e in path.ls():
        if not e.is_dir and not e.name.endswith(_WEIGHTS) and e.size <= CHUNK:
            (path / e.name).download(os.path.join(local, e.name))


def remote_config(path):
    """The transformers config of remote model directory `path`."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as local:
        fetch_small_files(path, local)
        return AutoConfig.from_pretrained(local)


def load_pretrained(cls, path, *model_args, config=None, device_map=None, dtype=None,
                    torch_dtype=None, attn_implementation=None, **ignored):
    """`cls.from_pretrained(rgpu.remote(path))`: the model made on the rgpu device that
    `device_map` names (default: the current one), its weights read on the server."""
    import transformers

    device = _rgpu_device(device_map if isinstance(device_map, (str, torch.device)) and
                          torch.device(device_map).type == "rgpu" else None)
    with tempfile.TemporaryDirectory() as local:
        fetch_small_files(path, local)
        if config is None:
            config = (cls.config_class or transformers.AutoConfig).from_pretrained(local)
        generation = None
        if os.path.exists(os.path.join(local, "generation_config.json")):
            generation = transformers.GenerationConfig.from_pretrained(local)
        index = os.path.join(local, "model.safetensors.index.json")
        shards = None
        if os.path.exists(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
    names = [e.name for e in path.ls() if not e.is_dir]
    if shards is None:
        shards = [n for n in names if n.endswith(".safetensors")]
    state = {}
    with torch.no_grad():
        for shard in shards:
            state.update(load_safetensors(path / shard, device))
        if not shards:
            for n in names:
                if n.endswith(".bin"):
                    state.update(torch.load(path / n, map_location=device, weights_only=True))
    if not state:
        raise FileNotFoundError(f"{path!r} has no weights (*.safetensors or *.bin)")
    kwargs = {"dtype": dtype if dtype is not None else torch_dtype} \
        if (dtype if dtype is not None else torch_dtype) not in (None, "auto") else {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device(device):
        model = cls._from_config(config, **kwargs) if not model_args else cls(config, *model_args)
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n in result.missing_keys if not _tied(model, n, state)]
    if missing:
        transformers.logging.get_logger(__name__).warning(
            f"{cls.__name__} from {path!r}: no weights for {missing} (left as initialized)")
    if generation is not None and model.can_generate():
        model.generation_config = generation
    return model.eval()


def _tied(model, name, state):
    """Whether parameter `name`, absent from the checkpoint, is tied to one it holds."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(name)
    return p is not None and any(q is p for n, q in params.items() if n in state)
