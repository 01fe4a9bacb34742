"""``torch.rgpu``: the device module, shaped like ``torch.cuda``."""

import torch

from . import _C


def is_available() -> bool:
    """True: rgpu tensors can always be created; the server is contacted at the first sync."""
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device) -> None:
    index = torch.device("rgpu", device).index if isinstance(device, int) else torch.device(device).index
    if index not in (None, 0):
        raise ValueError(f"rgpu has one device (rgpu:0), not rgpu:{index}")


def synchronize(device=None) -> None:
    """Runs everything traced so far and waits until the server has finished it."""
    _C.synchronize()


def manual_seed(seed: int) -> None:
    """Seeds the server-side generator of this session."""
    _C.seed(int(seed) & 0xFFFFFFFFFFFFFFFF)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


def _is_in_bad_fork() -> bool:
    return False
