"""Cheaper in-place shape checks for rgpu's traces.

Functionalization checks every in-place op (`p.lerp_(g, w)`, `x.add_(y)`) by running it on meta
tensors before it runs the functional op, so that broadcasting a larger tensor into `self`
fails as in eager. torch registers Python meta kernels for ~170 in-place ops, and the optimizers'
`_foreach_*_` ops call them once per parameter: on the small GPT's AdamW step that cost ~13 ms
of Python per step, four times the whole eager step.

The check depends only on the arguments' shapes, strides, dtypes, constant values (ints and
bools included), and on the floating scalar arguments' types. This module wraps each of those
Meta kernels with a memo of argument signatures that passed: a signature seen before returns at
once; anything new (and anything with symbolic shapes) runs the original kernel, which raises
as before. Kernels that change their tensor's metadata (`transpose_`, `resize_`) are left alone.
"""

import warnings

import torch

_lib = None


def _signature(args, kwargs):
    parts = []
    for a in list(args) + sorted(kwargs.items()):
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):
            parts.append(a[0])
            a = a[1]
        if isinstance(a, torch.Tensor):
            if a._has_symbolic_sizes_strides:
                return None
            parts.append((a.shape, a.stride(), a.dtype))
        elif isinstance(a, (list, tuple)):
            inner = _signature(a, {})
            if inner is None:
                return None
            parts.append(inner)
        elif isinstance(a, (bool, int)):
            parts.append((type(a), a))  # dims and sizes decide what the check accepts
        elif isinstance(a, (float, complex)):
            parts.append(type(a))  # values (lr, alpha) change every step; the check ignores them
        elif a is None or isinstance(a, (str, torch.dtype, torch.device, torch.layout,
                                         torch.memory_format)):
            parts.append(a)
        else:
            return None
    return tuple(parts)


def _memoized(fn):
    passed = {}  # signature -> whether the kernel returned self (else it returned None)

    def check(self, *args, **kwargs):
        key = _signature((self,) + args, kwargs)
        if key is not None and key in passed:
            return self if passed[key] else None
        out = fn(self, *args, **kwargs)
        if key is not None and len(passed) < 4096 and (out is self or out is None):
            passed[key] = out is self
        return out

    return check


def memoize_inplace_meta_checks():
    """Wraps torch's Python Meta kernels of in-place aten ops; idempotent."""
    global _lib
    if _lib is not None:
        return
    import torch._meta_registrations as registrations
    from torch._decomp import global_decomposition_table

    registered = registrations._meta_lib_dont_use_me_use_register_meta._op_impls
    _lib = torch.library.Library("aten", "IMPL", "Meta")
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for table in ("meta", "post_autograd", "pre_autograd"):
            for op, fn in global_decomposition_table[table].items():
                if not isinstance(op, torch._ops.OpOverload) or op in seen:
                    continue
                seen.add(op)
                name = op._schema.name.split("::")[1]
                overload = "" if op._overloadname == "default" else "." + op._overloadname
                if not name.endswith("_") or f"aten/{name}{overload}/Meta" not in registered:
                    continue
                # Kernels that change their tensor's sizes or strides (transpose_, resize_) must
                # run every time: skipping them would leave the metadata unchanged.
                if torch.Tag.inplace_view in op.tags or name.startswith(("resize", "set_")):
                    continue
                _lib.impl(op, _memoized(fn), allow_override=True)
