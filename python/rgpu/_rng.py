"""Saving and restoring rgpu's generator state without a round trip.

``torch.random.fork_rng`` and ``torch.utils.checkpoint`` save each device's generator state with
``get_rng_state`` and put it back with ``set_rng_state``. For rgpu, reading a state waits for
the server, and a checkpointed call reads it twice (in forward, and again around its
recomputation): a deep checkpointed model would wait two round trips per layer per step. Here
they save a *snapshot* instead: a generator of the session that takes the device generator's
state at that point of the trace, on the server, and gives it back when restored. Neither waits.
``torch.rgpu.get_rng_state`` itself still returns the state's bytes.
"""

import contextlib
import functools

import torch
import torch.utils.checkpoint as checkpoint

from . import _C
from . import device as rgpu_device


class _Snapshot:
    """The state of rgpu:``index``'s generator at one point of the trace, held by the server."""

    def __init__(self, index):
        self.index = index
        self.generator = _C.rng_snapshot(index)

    def restore(self):
        _C.rng_restore(self.generator, self.index)


def _is_rgpu(device_type):
    return device_type is not None and torch.device(device_type).type == "rgpu"


_original_fork_rng = torch.random.fork_rng


@contextlib.contextmanager
def _fork_rng(devices=None, enabled=True, _caller="fork_rng", _devices_kw="devices",
              device_type="cuda"):
    if not enabled or not _is_rgpu(device_type):
        with _original_fork_rng(devices, enabled, _caller, _devices_kw, device_type):
            yield
        return
    indices = range(rgpu_device.device_count()) if devices is None else devices
    cpu_state = torch.get_rng_state()
    saved = [_Snapshot(rgpu_device._index(d)) for d in indices]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        for snapshot in saved:
            snapshot.restore()


_original_get_device_states = checkpoint.get_device_states
_original_set_device_states = checkpoint.set_device_states


def _get_device_states(*args):
    devices = []

    def note(arg):  # each device once (torch lists one per tensor)
        if isinstance(arg, torch.Tensor) and arg.device.type == "rgpu" and \
                arg.get_device() not in devices:
            devices.append(arg.get_device())
        return arg

    torch.utils._pytree.tree_map(note, args)
    if not devices or checkpoint._infer_device_type(*args) != "rgpu":
        return _original_get_device_states(*args)
    return devices, [_Snapshot(d) for d in devices]


def _set_device_states(devices, states, *, device_type=None):
    if not all(isinstance(s, _Snapshot) for s in states):
        return _original_set_device_states(devices, states, device_type=device_type)
    for snapshot in states:
        snapshot.restore()


def install():
    torch.random.fork_rng = functools.wraps(_original_fork_rng)(_fork_rng)
    checkpoint.get_device_states = functools.wraps(_original_get_device_states)(_get_device_states)
    checkpoint.set_device_states = functools.wraps(_original_set_device_states)(_set_device_states)
