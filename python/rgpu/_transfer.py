"""Moving modules and saving tensors between the CPU and rgpu as PyTorch does for CUDA.

Four things differ from a CUDA tensor, and each is handled here:

* **Parameters and tied weights.** ``model.to("cuda")`` keeps every Parameter object
  (``param.data = new``), so an optimizer made before the move steps what the model computes
  with, and a weight shared by two modules stays one Parameter. ``.data =`` needs tensors of
  compatible kinds, and an rgpu tensor is a functionalization wrapper, which a CPU tensor
  cannot become; so a move between the CPU and rgpu swaps each Parameter's contents with its
  converted tensor (``torch.utils.swap_tensors``, torch's own way for such moves), and
  ``_apply`` below converts each distinct tensor once per move and gives every module that
  held it the same result.
* **One round trip per move.** Reading a tensor back waits for the server; a model moved to the
  CPU reads all of its tensors, so they are fetched together, in one frame.
* **Saving.** An rgpu tensor has no CPU-readable storage. ``torch.save`` fetches every rgpu
  tensor of what it saves in one frame and writes each as a CUDA tensor is written: its bytes
  in a storage tagged with its device (``rgpu:0``), so ``torch.load`` treats it as it treats
  a CUDA checkpoint (``map_location="cpu"``, a dict, or ``lambda storage, loc: storage`` all
  work, with or without rgpu installed). A plain ``pickle`` of an rgpu tensor is its CPU value
  with the device name, as for XLA tensors. ``torch.load`` puts storages bound for rgpu
  (tagged so, or mapped there: ``map_location="rgpu"`` or ``{"cuda:0": "rgpu:1"}``) on the
  CPU first, then uploads each once: torch's own path would allocate rgpu storages on the
  client, which holds no rgpu bytes. Tensors that shared a storage in the file stay views of
  one tensor.
  Savers that tell shared tensors apart by their storage's address (safetensors,
  ``save_pretrained``) get an address that, like a CUDA device pointer, is not readable here:
  equal for tensors that share storage (views, tied weights), different otherwise; a tensor's
  ``data_ptr()`` is that address plus its offset, as for CUDA.
* **Deep copies.** torch deep-copies a tensor by copying its storage, which for rgpu would be
  allocated on the client; an rgpu tensor deep-copies as a clone on the server, as XLA and lazy
  tensors do. Parameters already clone (so tied weights stay tied through the memo); tensors
  that were views of one storage become independent copies, as for XLA.
* **DLPack.** An rgpu tensor has no bytes here to share: ``__dlpack__`` and
  ``__dlpack_device__`` raise BufferError and ``torch.to_dlpack`` RuntimeError, saying to move
  it to the CPU, as a CPU-only consumer of a CUDA tensor would have to.
"""

import collections
import contextlib
import copy
import functools
import threading
import warnings

import torch

from . import _C

_state = threading.local()


@contextlib.contextmanager
def downloads_together(tensors):
    """The first download of any of ``tensors`` fetches all of them, in one round trip."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "rgpu"]
    if not tensors or getattr(_state, "grouped", False):
        yield
        return
    _state.grouped = True
    _C.download_together(tensors)
    try:
        yield
    finally:
        _state.grouped = False
        _C.download_together([])


def _module_tensors(module):
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                yield p
                if p.grad is not None:
                    yield p.grad
        yield from (b for b in m._buffers.values() if b is not None)


class _Move:
    """One call of Module._apply and everything it converts: each tensor once, and each
    Parameter replaced by one new Parameter, whichever modules hold it."""

    def __init__(self, fn):
        self.results = {}
        self.params = {}

        @functools.wraps(fn)
        def convert(t):
            hit = self.results.get(id(t))
            if hit is not None and hit[0] is t:
                out, where = hit[1], hit[2]
                # A Parameter (or its grad) that torch swapped with its result holds the
                # result now, and the result what it held.
                return out if (out.device, out.dtype) == where else t
            out = fn(t)
            # Holds t, so that its id is not reused meanwhile.
            self.results[id(t)] = (t, out, (out.device, out.dtype))
            return out

        convert._rgpu_move = self
        self.fn = convert


_original_apply = torch.nn.Module._apply


def _apply(self, fn, recurse=True):
    move = getattr(fn, "_rgpu_move", None)
    if move is None:
        move = _Move(fn)
        # Every tensor converted first, together (one round trip for a move to the CPU); the
        # modules then take the converted tensors (converted once each) from the move.
        with downloads_together(_module_tensors(self)):
            for t in _module_tensors(self):
                move.fn(t)
        try:
            with _keeping_parameters(self, move):
                return _apply_once(self, move, recurse)
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
            # A Parameter that something else holds too (a live autograd graph, a weak
            # reference) cannot be swapped: the rest get new Parameters, as before.
            warnings.warn(f"moving {type(self).__name__} between the CPU and rgpu made new "
                          f"Parameter objects ({e}): make optimizers after the move",
                          stacklevel=3)
            return _apply_once(self, move, recurse)
    return _apply_once(self, move, recurse)


@contextlib.contextmanager
def _keeping_parameters(module, move):
    """A move between the CPU and rgpu keeps every Parameter object, as a move to CUDA does: an
    optimizer made before `model.to("rgpu")` (accelerate's `prepare(model, optimizer)` does
    that) steps the parameters the model computes with. `.data =` cannot make a CPU tensor an
    rgpu one, so the move swaps each Parameter's contents with its converted tensor
    (torch.utils.swap_tensors, torch's own way for such moves)."""
    first = next(module.parameters(), None)
    crosses = first is not None and "rgpu" in (first.device.type, move.fn(first).device.type)
    if not crosses or torch.__future__.get_swap_module_params_on_conversion():
        yield
        return
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _apply_once(module, move, recurse):
    before = dict(module._parameters)
    out = _original_apply(module, move.fn, recurse)
    for key, old in before.items():
        if old is None:
            continue
        new = module._parameters.get(key)
        kept = move.params.setdefault(id(old), (old, new))[1]
        if kept is not new:
            module._parameters[key] = kept
    return out


_original_reduce = torch.Tensor._reduce_ex_internal


@contextlib.contextmanager
def saving_remote(stand_ins, location):
    """torch.save to a remote path (rgpu.remote): each rgpu tensor is pickled as a CPU stand-in
    whose storage is never touched (`stand_ins` maps it to the tensor), tagged with the server
    device `location(device)` names."""
    outer = getattr(_state, "remote", None), getattr(_state, "tags", None), \
        getattr(_state, "saved", None)
    _state.remote, _state.tags, _state.saved = (stand_ins, location), {}, {}
    _state.saving = getattr(_state, "saving", 0) + 1
    try:
        yield
    finally:
        _state.saving -= 1
        _state.remote, _state.tags, _state.saved = outer


def _reduce_ex_internal(self, proto):
    if self.device.type != "rgpu":
        return _original_reduce(self, proto)
    remote = getattr(_state, "remote", None)
    if remote is not None:
        stand_ins, location = remote

        def stand_in():  # a CPU tensor of its layout whose memory is never touched
            from .remote import _remote_tensor

            t = _remote_tensor(self.detach())
            cpu = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
            stand_ins[cpu.untyped_storage()._cdata] = t
            _state.tags[cpu.untyped_storage()._cdata] = (location(self.device), cpu)
            return cpu

        return _original_reduce(_saved_as(self, stand_in), proto)
    if torch.serialization._serialization_tls.skip_data:
        raise RuntimeError("rgpu tensors cannot be saved under torch.serialization.skip_data: "
                           "their data lives on the server")
    if not getattr(_state, "saving", 0):
        with torch.no_grad():
            cpu = self.cpu()  # not self.detach(): that is a new alias, fetched on its own
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (cpu, self.dtype, str(self.device), self.requires_grad))

    def fetched():
        with torch.no_grad():
            cpu = self.cpu()
        _state.tags[cpu.untyped_storage()._cdata] = (str(self.device), cpu)
        return cpu

    return _original_reduce(_saved_as(self, fetched), proto)


def _view_key(t):
    """What two rgpu tensors that are the same view of one storage have in common."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device)


def _distinct_views(tensors):
    """`tensors` without the rgpu tensors that repeat an earlier one's view."""
    seen = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "rgpu":
            key = _view_key(t)
            if key in seen:
                continue
            seen.add(key)
        yield t


def _saved_as(self, make):
    """The CPU tensor that stands for rgpu tensor `self` in the torch.save in progress, made by
    `make` once per distinct view: the aliases state_dict() gives of tied weights are one
    storage in the file (and one download), as on the CPU."""
    key = _view_key(self)
    if key not in _state.saved:
        _state.saved[key] = make()
    out = _state.saved[key].detach()
    return out.requires_grad_(self.requires_grad)


def _tag(storage):
    """torch.save's location of a storage: the rgpu device of the tensor it was fetched from."""
    tags = getattr(_state, "tags", None)
    entry = tags and tags.get(getattr(storage, "_untyped_storage", storage)._cdata)
    return entry[0] if entry else None


def _restore(storage, location):
    """torch.load's restore of a storage tagged with an rgpu device: kept on the CPU, noted, and
    uploaded once the whole object is read (_load)."""
    targets = getattr(_state, "targets", None)
    device = _rgpu_target(location) if targets is not None else None
    if device is None:
        return None
    targets[storage.data_ptr()] = device
    return storage


def _tensors_in(obj, depth=0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 8 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, torch.nn.Module):
        yield from _module_tensors(obj)


_original_save = torch.save


@functools.wraps(_original_save)
def _save(obj, f, *args, **kwargs):
    from .remote import RemotePath, save as save_remote

    if isinstance(f, RemotePath):
        return save_remote(obj, f, *args[:1], **{k: v for k, v in kwargs.items()
                                                 if k in ("pickle_module", "pickle_protocol")})
    outermost = not getattr(_state, "saving", 0)
    if outermost:
        _state.tags = {}  # storage -> (device, the fetched tensor that keeps it alive)
        _state.saved = {}  # a view of an rgpu storage -> the CPU tensor saved for it
    _state.saving = getattr(_state, "saving", 0) + 1
    try:
        with downloads_together(_distinct_views(_tensors_in(obj))):
            return _original_save(obj, f, *args, **kwargs)
    finally:
        _state.saving -= 1
        if outermost:
            _state.tags, _state.saved = {}, {}


_original_load = torch.load


def _rgpu_target(where):
    """The rgpu device `where` (a map_location's destination) names, or None."""
    try:
        device = torch.device(where)
    except (RuntimeError, TypeError):
        return None
    return device if device.type == "rgpu" else None


def _storage_key(t):
    """What tensors that share a storage (as the same dtype) have in common."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes(), t.dtype


def map_tensors(obj, fn, depth=0, memo=None):
    """`obj` with each tensor `t` for which `fn(t)` is not None replaced by that (a Parameter by
    a Parameter, with requires_grad kept), in dicts, lists and tuples; a module's tensors are
    replaced in place. A tensor met twice (tied weights) is replaced by one tensor."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)][1]
        new = fn(obj)
        if new is None:
            new = obj
        elif isinstance(obj, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=obj.requires_grad)
        elif obj.requires_grad and not new.requires_grad:
            new = new.requires_grad_()
        memo[id(obj)] = (obj, new)  # holds obj, so that its id is not reused meanwhile
        return new
    if isinstance(obj, torch.nn.Module):
        results = {id(t): (t, fn(t)) for t in _module_tensors(obj)}
        if all(new is None for _, new in results.values()):
            return obj
        return obj._apply(lambda t: _either(results.get(id(t), (None, None))[1], t))
    if depth < 8 and isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = map_tensors(v, fn, depth + 1, memo)
        if hasattr(obj, "_metadata"):  # a state_dict's module versions
            out._metadata = obj._metadata
        return out
    if depth < 8 and isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(map_tensors(v, fn, depth + 1, memo) for v in obj)
    return obj


def _either(new, old):
    return old if new is None else new


def _to_device(obj, everything, targets, uses):
    """`obj` with each CPU tensor whose storage `targets` maps to an rgpu device moved there;
    tensors of one storage become views of one upload of it. `everything`: the device that a
    single map_location sends all tensors to (rgpu tensors and modules included), or None."""
    bases = {}

    def convert(t):
        if t.device.type != "cpu":
            return t.detach().to(everything) if everything is not None else None
        storage = t.untyped_storage()
        device = targets.get(storage.data_ptr())
        if device is None:
            return None
        key = _storage_key(t)
        whole = t.storage_offset() == 0 and t.is_contiguous() and \
            t.numel() * t.element_size() == storage.nbytes()
        if uses[key] == 1 and whole:
            return t.detach().to(device)
        if key not in bases:
            flat = torch.empty(0, dtype=t.dtype).set_(
                storage, 0, (storage.nbytes() // t.element_size(),), (1,))
            bases[key] = flat.to(device)
        return bases[key].as_strided(t.size(), t.stride(), t.storage_offset())

    return map_tensors(obj, convert)


@functools.wraps(_original_load)
def _load(f, map_location=None, *args, **kwargs):
    from .remote import RemotePath, load as load_remote

    if isinstance(f, RemotePath):
        return load_remote(f, map_location, *args, **kwargs)
    everything = _rgpu_target(map_location) if isinstance(map_location, (str, torch.device)) \
        else None
    mapped = isinstance(map_location, dict) and any(map(_rgpu_target, map_location.values()))
    targets = {}  # storage data_ptr -> the rgpu device its tensors go to

    def restore(storage, location):  # torch's, whose first package is _restore
        where = everything or map_location.get(location, location)
        return torch.serialization.default_restore_location(storage, str(where))

    outer, _state.targets = getattr(_state, "targets", None), targets
    try:
        obj = _original_load(f, restore if everything or mapped else map_location, *args, **kwargs)
    finally:
        _state.targets = outer
    if not targets and everything is None:
        return obj
    uses = collections.Counter(_storage_key(t) for t in _tensors_in(obj) if t.device.type == "cpu")
    with torch.no_grad():
        return _to_device(obj, everything, targets, uses)


_original_deepcopy = torch.Tensor.__deepcopy__


def _deepcopy(self, memo):
    if type(self) is not torch.Tensor or self.device.type != "rgpu" or not self.is_leaf or \
            id(self) in memo:
        return _original_deepcopy(self, memo)
    with torch.no_grad():
        new = self.clone(memory_format=torch.preserve_format)
    if self.requires_grad:
        new.requires_grad_()
    if self.grad is not None:
        new.grad = self.grad.__deepcopy__(memo)
    self._clear_non_serializable_cached_data()
    new.__dict__ = copy.deepcopy(self.__dict__, memo)
    memo[id(self)] = new
    return new


_original_storage_data_ptr = torch.UntypedStorage.data_ptr


def _storage_data_ptr(self):
    if self.device.type == "rgpu":
        return self._cdata  # the storage's identity; its bytes are on the server
    return _original_storage_data_ptr(self)


_original_tensor_data_ptr = torch.Tensor.data_ptr


def _tensor_data_ptr(self):
    if self.device.type == "rgpu":
        return self.untyped_storage().data_ptr() + self.storage_offset() * self.element_size()
    return _original_tensor_data_ptr(self)


_DLPACK_REFUSED = ("an rgpu tensor's bytes are on the rgpu-opserver, not in this process: "
                   "DLPack cannot share them. Move it to the CPU first (x.cpu()), as for a CUDA "
                   "tensor and a CPU-only consumer")
_original_dunder_dlpack = torch.Tensor.__dlpack__
_original_dunder_dlpack_device = torch.Tensor.__dlpack_device__
_original_to_dlpack = torch.utils.dlpack.to_dlpack


def _dunder_dlpack(self, *args, **kwargs):
    if self.device.type == "rgpu":
        raise BufferError(_DLPACK_REFUSED)
    return _original_dunder_dlpack(self, *args, **kwargs)


def _dunder_dlpack_device(self):
    if self.device.type == "rgpu":
        raise BufferError(_DLPACK_REFUSED)
    return _original_dunder_dlpack_device(self)


def _to_dlpack(tensor, *args, **kwargs):
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "rgpu":
        raise RuntimeError(_DLPACK_REFUSED)
    return _original_to_dlpack(tensor, *args, **kwargs)


def install():
    # to_dlpack handed out a capsule over no bytes: torch.from_dlpack of it made a tensor that
    # failed on first use with a misleading device error.
    torch.Tensor.__dlpack__ = functools.wraps(_original_dunder_dlpack)(_dunder_dlpack)
    torch.Tensor.__dlpack_device__ = functools.wraps(_original_dunder_dlpack_device)(
        _dunder_dlpack_device)
    torch.utils.dlpack.to_dlpack = torch.to_dlpack = functools.wraps(_original_to_dlpack)(_to_dlpack)
    torch.UntypedStorage.data_ptr = _storage_data_ptr
    torch.Tensor.data_ptr = functools.wraps(_original_tensor_data_ptr)(_tensor_data_ptr)
    torch.nn.Module._apply = _apply
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal
    torch.Tensor.__deepcopy__ = functools.wraps(_original_deepcopy)(_deepcopy)
    torch.save = torch.serialization.save = _save
    torch.load = torch.serialization.load = _load
    torch.serialization.register_package(9, _tag, _restore)
