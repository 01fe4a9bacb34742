"""A view of `torch` in which rgpu tensors are not functionalization wrappers."""


class TorchSeeingRgpuAsDense:
    """`torch`, as torch._subclasses.meta_utils sees it, with rgpu tensors not functional.

    Every rgpu tensor is a functionalization wrapper around the lazy tensor (that is how views
    and in-place ops become a functional graph). Dynamo's fake-tensor conversion treats such
    wrappers as functorch's own and rebuilds autograd metadata that turns leaf parameters into
    non-leaves; it exempts XLA and torch._lazy tensors, which are built the same way, by device
    type. This view of `torch` gives rgpu tensors the same exemption, in that module only.
    Printing uses it too: torch's formatter would show the wrapper instead of the tensor.
    """

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _is_functional_tensor(self, t):
        return t.device.type != "rgpu" and self._real._is_functional_tensor(t)
