"""Values that arrive without a wait: step closures (on_ready, flush) and uploads ahead of need.

Every run's small outputs (a loss, an accuracy, a gradient norm) come back in the reply to that
run, which the client takes in whenever it next talks to the server; reading such a value once
its reply is in costs no round trip. ``on_ready`` builds on that: the callback runs, on the
user's thread, at the first sync point (an optimizer step, ``mark_step``, another ``on_ready``)
after every value it needs has arrived.
"""

import collections

import torch
from torch.utils._pytree import tree_map

from . import _C

_waiting = collections.deque()  # (fn, tensors), delivered in the order they were registered
_delivering = False


def _is_rgpu(t):
    return isinstance(t, torch.Tensor) and t.device.type == "rgpu"


def on_ready(fn, *tensors) -> None:
    """Calls ``fn(*values)`` with the CPU values of ``tensors`` once they have arrived, without
    waiting for them: the way to log from a training loop whose server is far away.

    ``fn`` runs on this thread, at the first sync point after the values are in (the next
    optimizer step, ``rgpu.mark_step()``, ``on_ready``, ``rgpu.flush()``), and callbacks run in the
    order they were registered. Small tensors come back with their run's reply anyway; a larger
    one is fetched in the background. Arguments that are not rgpu tensors are passed unchanged.
    ``rgpu.flush()`` at the end of training delivers the rest.

        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rgpu.on_ready(lambda l: print(f"loss {l.item():.4f}"), loss)
        rgpu.flush()
    """
    for t in tensors:
        if _is_rgpu(t):
            _C.request_value(t)
    _waiting.append((fn, tensors))
    deliver()


def flush() -> None:
    """Runs every ``on_ready`` callback still waiting, waiting for the values it needs: one
    round trip however many there are (the replies come in order, so waiting for the last
    frame's brings every value asked for before it)."""
    if any(_is_rgpu(t) and not _C.has_value(t) for _, tensors in _waiting for t in tensors):
        from . import RemoteError

        try:
            _C.mark_step(wait=True, reason="rgpu.flush")
        except RemoteError:
            deliver(wait=True)  # raises for the value the error is about, dropping its callback
            raise
    deliver(wait=True)


def deliver(wait: bool = False) -> None:
    """Runs the waiting callbacks whose values are here (all of them, waiting, with ``wait``)."""
    global _delivering
    if _delivering:
        return
    _delivering = True
    try:
        while _waiting:
            fn, tensors = _waiting[0]
            if not wait and not all(_C.has_value(t) for t in tensors if _is_rgpu(t)):
                break
            _waiting.popleft()
            fn(*[t.cpu().detach() if _is_rgpu(t) else t for t in tensors])
    finally:
        _delivering = False


def prefetch(batches, depth: int = 2, device="rgpu"):
    """Yields the items of ``batches`` (a DataLoader, any iterable) with their tensors moved to
    ``device``, uploading ``depth`` items ahead: a batch's bytes travel while earlier steps run,
    off the step's critical path. Items may be tensors, or tuples, lists and dicts of them.
    """
    if depth < 1:
        raise ValueError(f"rgpu.prefetch: depth must be at least 1, not {depth}")

    def move(item):
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, item)

    source = iter(batches)
    ahead = collections.deque()

    def fetch():
        try:
            ahead.append(move(next(source)))
        except StopIteration:
            return False
        _C.send()
        return True

    while len(ahead) < depth and fetch():
        pass
    while ahead:
        item = ahead.popleft()
        fetch()
        yield item
