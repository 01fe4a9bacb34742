"""Cheaper in-place shape checks for rgpu's traces.

Functionalization checks every in-place op (`p.lerp_(g, w)`, `x.add_(y)`) by running it on meta
tensors before it runs the functional op. torch registers Python meta kernels for ~170 in-place
ops, and the optimizers' `_foreach_*_` ops call them once per parameter. This module puts a C++
kernel in front of each of them that remembers the argument signatures that passed
(include/rgpu/client/InplaceChecks.h): a signature seen before costs no Python; anything new
(and anything with symbolic shapes) runs the original kernel, which raises as before. Kernels
that change their tensor's metadata (`transpose_`, `resize_`) are left alone.
"""

import warnings

import torch

from . import _C

_done = False


def memoize_inplace_meta_checks():
    """Puts the memo in front of torch's Python Meta kernels of in-place aten ops; idempotent."""
    global _done
    if _done:
        return
    _done = True
    import torch._meta_registrations as registrations
    from torch._decomp import global_decomposition_table

    registered = registrations._meta_lib_dont_use_me_use_register_meta._op_impls
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
                _C._memoize_meta_check(op._schema.name, op._overloadname
                                       if op._overloadname != "default" else "", fn)
    # In-place ops that CPU refuses on repeating tensors and torch checks in C++ Meta kernels
    # that skip the check (lib/client/InplaceChecks.cpp).
    for name, overload in (("copy_", ""), ("random_", ""), ("random_", "from"), ("random_", "to")):
        _C._guard_meta_kernel("aten::" + name, overload)
