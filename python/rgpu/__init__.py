"""rgpu: a PyTorch device whose tensors live on a remote GPU.

``import rgpu`` registers the ``rgpu`` device. Every op on an rgpu tensor is traced into a lazy
graph; at a sync point (``.item()``, ``.cpu()``, printing, ``torch.rgpu.synchronize()``, ...)
the graph is cut, hashed, shipped to ``rgpu-opserver`` once and run there. Later steps send only
the hash, the tensor handles and the Python scalar values.

The server address comes from ``RGPU_OPSERVER`` (default ``127.0.0.1:9720``) or
``rgpu.set_server("host:port")``.
"""

import os

import torch

__all__ = [
    "RemoteError",
    "SessionLost",
    "mark_step",
    "set_server",
    "stats",
    "synchronize",
]


class RemoteError(RuntimeError):
    """An aten op failed on the server. The message names the op and your source line."""


class SessionLost(RuntimeError):
    """The connection to rgpu-opserver is gone, and with it every rgpu tensor."""


torch.utils.rename_privateuse1_backend("rgpu")

from . import _C  # noqa: E402  (the backend must be named before the kernels register)
from . import device as _device_module  # noqa: E402

_C._install(
    RemoteError,
    SessionLost,
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(__file__) + os.sep,
)
torch._register_device_module("rgpu", _device_module)
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=False
)


def set_server(address: str) -> None:
    """Points the client at ``host:port``; takes effect at the first connection."""
    _C.set_server(address)


def stats() -> dict:
    """Client counters since the process started.

    ``messages`` (frames sent), ``waits`` (blocking round trips), ``bytes_out``, ``bytes_in``,
    ``graphs_shipped`` (graphs sent in full), ``graph_runs``, ``ops_traced``, ``uploads``,
    ``downloads``, ``live_tensors``.
    """
    return _C.stats()


def mark_step(wait: bool = False) -> None:
    """Cuts the pending trace into a graph and sends it to run, without waiting by default."""
    _C.mark_step(wait)


def synchronize() -> None:
    """Runs everything traced so far and waits for the server to finish it."""
    _C.synchronize()


def _optimizer_step_boundary(optimizer, args, kwargs):
    # The end of an optimizer step is a natural graph boundary: cutting here (without waiting)
    # keeps a loop that never syncs bounded, and gives graphs that repeat step after step.
    _C.mark_step(False)


from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

register_optimizer_step_post_hook(_optimizer_step_boundary)


def _patch_printing():
    # Printing formats with many small ops (slicing, masked_select, ...). Like XLA and lazy
    # tensors, an rgpu tensor is brought to the CPU once and formatted there.
    import torch._tensor_str as ts

    original = ts._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == "rgpu":
            self = self.cpu()
        return original(self, indent)

    ts._tensor_str = _tensor_str


def _patch_copy_into_other_devices():
    # cpu_tensor.copy_(rgpu_tensor) would reach functionalization with a non-functional
    # destination, which it refuses; route it through a download instead.
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if isinstance(src, torch.Tensor) and src.device.type == "rgpu" and self.device.type != "rgpu":
            src = src.to(self.device)
        return original(self, src, non_blocking)

    copy_.__doc__ = original.__doc__
    torch.Tensor.copy_ = copy_


_patch_printing()
_patch_copy_into_other_devices()
