"""In-place ops that functionalization cannot take as they are, done as CPU eager does them.

* **Fills through an expand.** Functionalization writes through an expanded view as a sum over
  its copies (`x.expand(2, 3).fill_(5)` would make a 1 into 9); CPU writes each shared element
  again with the same value. `fill_` and `zero_` on a tensor that repeats elements fill the
  view with each repeated dimension narrowed to one element, which writes every element once.
  Other writes through such a tensor are refused at the call (lib/client/InplaceChecks.cpp).
* **fill_diagonal_ of a view.** torch writes the diagonal through an as_strided() of the
  tensor, which functionalization refuses on a view. On an rgpu view the diagonal is filled
  through a mask of its positions instead; a wrapped diagonal, which follows the view's memory
  layout, is refused with a clear error.
* **polygamma_** has no functionalization kernel in torch; it runs as `polygamma` copied back.
"""

import functools

import torch


def _repeats(t):
    """Whether `t` shows one element at several places (a dimension of stride 0)."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _narrowed(t):
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(d, 0, 1)
    return t


def _on_rgpu(t):
    return isinstance(t, torch.Tensor) and t.device.type == "rgpu"


def _patch_fills():
    for owner, name in ((torch.Tensor, "fill_"), (torch.Tensor, "zero_"), (torch, "fill_"),
                        (torch, "zero_")):
        original = getattr(owner, name)

        def fill(self, *args, _original=original, **kwargs):
            if _on_rgpu(self) and _repeats(self):
                _original(_narrowed(self), *args, **kwargs)
                return self
            return _original(self, *args, **kwargs)

        setattr(owner, name, functools.wraps(original)(fill))


def _patch_fill_diagonal():
    original = torch.Tensor.fill_diagonal_

    @functools.wraps(original)
    def fill_diagonal_(self, fill_value, wrap=False):
        if not (_on_rgpu(self) and self._base is not None and self.dim() >= 2):
            return original(self, fill_value, wrap)
        if self.dim() > 2 and len(set(self.shape)) != 1:
            raise RuntimeError("all dimensions of input must be of equal length")
        height, width = self.shape[0], self.shape[1]
        if wrap and self.dim() == 2 and height > width + 1:
            raise NotImplementedError(
                "rgpu: fill_diagonal_(wrap=True) of a view of a tall matrix follows the view's "
                "memory layout, which rgpu does not reproduce; call it on a contiguous tensor")
        index = torch.arange(min(self.shape), device=self.device)
        mask = torch.zeros(self.shape, dtype=torch.bool, device=self.device)
        mask[(index,) * self.dim()] = True
        return self.masked_fill_(mask, fill_value)

    torch.Tensor.fill_diagonal_ = fill_diagonal_


def _patch_polygamma():
    original = torch.Tensor.polygamma_

    @functools.wraps(original)
    def polygamma_(self, n):
        if not _on_rgpu(self):
            return original(self, n)
        return self.copy_(torch.polygamma(n, self))

    torch.Tensor.polygamma_ = polygamma_


def install():
    _patch_fills()
    _patch_fill_diagonal()
    _patch_polygamma()
