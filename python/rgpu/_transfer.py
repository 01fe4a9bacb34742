"""Moving modules and saving tensors between the CPU and rgpu as PyTorch does for CUDA.

Three things differ from a CUDA tensor, and each is handled here:

* **Tied weights.** ``model.to("cuda")`` keeps every Parameter object (``param.data = new``), so
  a weight shared by two modules stays one Parameter. That path needs tensors of compatible
  kinds; an rgpu tensor is a functionalization wrapper, which a CPU tensor's storage cannot
  become, so ``nn.Module._apply`` makes a new Parameter per module, and a tied weight would
  silently become two. ``_apply`` below converts each distinct tensor once per move and gives
  every module that held it the same result.
* **One round trip per move.** Reading a tensor back waits for the server; a model moved to the
  CPU reads all of its tensors, so they are fetched together, in one frame.
* **Saving.** An rgpu tensor has no CPU-readable storage, so it pickles the way XLA tensors do:
  as its CPU value with the device name, rebuilt on rgpu by ``torch.load`` (which honours
  ``map_location``). ``torch.save`` fetches every rgpu tensor of what it saves in one frame.
  Savers that tell shared tensors apart by their storage's address (safetensors,
  ``save_pretrained``) get an address that, like a CUDA device pointer, is not readable here:
  equal for tensors that share storage (views, tied weights), different otherwise; a tensor's
  ``data_ptr()`` is that address plus its offset, as for CUDA.
"""

import contextlib
import functools
import threading

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
                return hit[1]
            out = fn(t)
            self.results[id(t)] = (t, out)  # holds t, so its id is not reused meanwhile
            return out

        convert._rgpu_move = self
        self.fn = convert


_original_apply = torch.nn.Module._apply


def _apply(self, fn, recurse=True):
    move = getattr(fn, "_rgpu_move", None)
    if move is None:
        move = _Move(fn)
        with downloads_together(_module_tensors(self)):
            return _apply_once(self, move, recurse)
    return _apply_once(self, move, recurse)


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


def _reduce_ex_internal(self, proto):
    if self.device.type != "rgpu":
        return _original_reduce(self, proto)
    if torch.serialization._serialization_tls.skip_data:
        raise RuntimeError("rgpu tensors cannot be saved under torch.serialization.skip_data: "
                           "their data lives on the server")
    with torch.no_grad():
        cpu = self.cpu()  # not self.detach(): that is a new alias, fetched on its own
    return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (cpu, self.dtype, str(self.device), self.requires_grad))


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
def _save(obj, *args, **kwargs):
    with downloads_together(_tensors_in(obj)):
        return _original_save(obj, *args, **kwargs)


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


def install():
    torch.UntypedStorage.data_ptr = _storage_data_ptr
    torch.Tensor.data_ptr = functools.wraps(_original_tensor_data_ptr)(_tensor_data_ptr)
    torch.nn.Module._apply = _apply
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal
    torch.save = torch.serialization.save = _save
