"""``torch.rgpu``: the device module, shaped like ``torch.cuda``."""

from dataclasses import dataclass

import torch

from . import _C


def is_available() -> bool:
    """True: rgpu tensors can always be created; the server is contacted at the first sync."""
    return True


def is_initialized() -> bool:
    """True, as for an initialized torch.cuda: rgpu needs no initialization call."""
    return True


def device_count() -> int:
    """The server's devices (``rgpu-opserver --devices``): rgpu:0 .. rgpu:n-1. Asking connects
    to the server if no sync has yet."""
    return _C.device_count()


def current_device() -> int:
    """This thread's current device: where ``device="rgpu"`` puts tensors."""
    return _C.current_device()


def _index(device) -> int:
    """The index of ``device`` (an int, "rgpu:1", a torch.device; None: the current one),
    checked against the server's devices."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "rgpu":
            raise ValueError(f"expected an rgpu device, got {device}")
        index = current_device() if device.index is None else device.index
    count = device_count()
    if not 0 <= index < count:
        raise ValueError(f"rgpu:{index} does not exist: the server has {count} device(s), "
                         f"rgpu:0 to rgpu:{count - 1} (rgpu-opserver --devices)")
    return index


def set_device(device) -> None:
    """Makes ``device`` this thread's current rgpu device, as ``torch.cuda.set_device``."""
    _C.set_device(_index(device))


class device:
    """Context manager that makes ``index`` the current rgpu device, as ``torch.cuda.device``."""

    def __init__(self, index):
        self.index = None if index is None or index == -1 else _index(index)
        self.previous = None

    def __enter__(self):
        self.previous = current_device()
        if self.index is not None:
            _C.set_device(self.index)

    def __exit__(self, *exc):
        _C.set_device(self.previous)
        return False


class device_of(device):
    """Makes the device of tensor ``obj`` current, as ``torch.cuda.device_of``; a non-rgpu
    tensor changes nothing."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "rgpu" else None)


def synchronize(device=None) -> None:
    """Runs everything traced so far and waits until the server has finished it."""
    _C.synchronize()


# Random numbers. Each device has one generator per session, on the server, which every random
# op without an explicit generator draws from; these functions are torch.cuda's for it. Seeding
# or setting a state acts where it is called (the trace is cut first if a random op is pending,
# so ops traced before draw before) and sends no message of its own; reading a state is a round
# trip, after everything traced so far has drawn.

_initialized = True  # torch.utils.checkpoint saves device RNG states only where this is set


def manual_seed(seed: int) -> None:
    """Seeds the session's generator of every device (as ``torch.manual_seed`` seeds every
    device's): a server has one generator per physical device."""
    _C.seed(int(seed) & 0xFFFFFFFFFFFFFFFF)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    """Seeds the generators with a non-deterministic random number, as ``torch.cuda.seed``."""
    manual_seed(torch.seed())


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    """The seed the current device's generator was last seeded with."""
    return _C.rng_state(current_device())[1]


def get_rng_state(device="rgpu") -> torch.Tensor:
    """The state of ``device``'s generator as a CPU ByteTensor, after every op traced so far
    has drawn: 5056 bytes from a CPU server, 16 from a CUDA one. One round trip."""
    state, _ = _C.rng_state(_index(device))
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def set_rng_state(new_state: torch.Tensor, device="rgpu") -> None:
    """Sets ``device``'s generator to a state ``get_rng_state`` gave: ops traced after this
    call draw from it. Sent with the next message; a state of the wrong size or with bad
    values raises ``RemoteError`` at the next sync."""
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("set_rng_state expects a torch.ByteTensor, as get_rng_state returns")
    data = new_state.detach().cpu().contiguous().numpy().tobytes()
    _C.set_rng_state(_index(device), data)


def get_rng_state_all() -> list:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# Streams and events. An rgpu device has one stream, which runs work in the order it was traced:
# every stream is that stream (as ordered as any program's streams need), waiting on a stream
# or event waits for everything traced so far, and an event has no device clock to time.


def Stream(device=None, priority=0) -> torch.Stream:
    """A stream of ``device``: its one stream."""
    return torch.Stream(torch.device("rgpu", _index(device)), priority=priority)


def current_stream(device=None) -> torch.Stream:
    return Stream(device)


default_stream = current_stream


class stream:
    """``with torch.rgpu.stream(s):`` as ``torch.cuda.stream``; work stays in trace order."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def Event(enable_timing=False, blocking=False, interprocess=False) -> torch.Event:
    """An event of the current device; ``elapsed_time`` raises (no device clock)."""
    return torch.Event(torch.device("rgpu", current_device()), enable_timing=enable_timing,
                       blocking=blocking, interprocess=interprocess)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Whether the server's device computes in bfloat16: a CPU server does, CUDA from compute
    capability 8.0 (or with emulation, as ``torch.cuda.is_bf16_supported``)."""
    if including_emulation:
        return True
    m = _memory(None)
    return m["device"].startswith("cpu") or m["major"] >= 8


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


def _is_in_bad_fork() -> bool:
    return False


# Memory and device facts, answered by the server for its device. As torch.cuda's figures are
# the whole process's, these are the whole server's (every session's tensors): on CUDA its
# caching allocator's; on a CPU server the bytes all sessions hold and the machine's memory
# under --memory-limit. Each call runs what is pending first (so its tensors are counted) and
# costs one round trip.


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` gives, for the server's device. ``type`` is
    ``"cuda"`` or ``"cpu"``; a CPU server reports its cores as ``multi_processor_count`` and a
    compute capability of 0.0."""

    name: str
    type: str
    total_memory: int
    multi_processor_count: int
    major: int
    minor: int


def _memory(device=None, reset_peak=False, empty_cache=False) -> dict:
    return _C.device_memory(_index(device), reset_peak, empty_cache)


def memory_allocated(device=None) -> int:
    """Bytes the server's device holds in tensors."""
    return _memory(device)["allocated"]


def max_memory_allocated(device=None) -> int:
    """The most ``memory_allocated`` has been since the server started or the last
    ``reset_peak_memory_stats``."""
    return _memory(device)["allocated_peak"]


def memory_reserved(device=None) -> int:
    """Bytes the server's allocator holds, cached blocks included."""
    return _memory(device)["reserved"]


def max_memory_reserved(device=None) -> int:
    return _memory(device)["reserved_peak"]


def memory_stats(device=None) -> dict:
    """The keys of ``torch.cuda.memory_stats`` that rgpu knows."""
    m = _memory(device)
    return {
        "allocated_bytes.all.current": m["allocated"],
        "allocated_bytes.all.peak": m["allocated_peak"],
        "reserved_bytes.all.current": m["reserved"],
        "reserved_bytes.all.peak": m["reserved_peak"],
    }


def reset_peak_memory_stats(device=None) -> None:
    _memory(device, reset_peak=True)


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def empty_cache() -> None:
    """Gives the server allocator's cached blocks that no tensor uses back to the device.
    Before this process has started its session there is nothing of it to give back: as
    torch.cuda's before CUDA starts, it does nothing (frameworks call it on the CPU too)."""
    if not _C.started():
        return
    for index in range(device_count()):
        _memory(index, empty_cache=True)


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of the server's device."""
    m = _memory(device)
    return m["free"], m["total"]


def get_device_properties(device=None) -> DeviceProperties:
    m = _memory(device)
    return DeviceProperties(m["name"], m["device"].split(":")[0], m["total"],
                            m["multi_processors"], m["major"], m["minor"])


def get_device_name(device=None) -> str:
    return _memory(device)["name"]


def get_device_capability(device=None) -> tuple:
    m = _memory(device)
    return m["major"], m["minor"]
