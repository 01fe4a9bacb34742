"""Fused optimizers (``AdamW(fused=True)``, ...) on rgpu parameters.

torch.optim's fused steps call one in-place op over lists of tensors (``torch._fused_adamw_``).
Functionalization refuses those calls whenever one of the lists is empty (AdamW without amsgrad
passes an empty ``max_exp_avg_sqs``): it takes the empty list for a non-functional tensor. So on
rgpu the step runs as the functional op, whose results are copied back into the optimizer's
tensors, which is exactly what functionalization would have traced.

The learning rate goes as a 0-dim CPU tensor (the op's ``tensor_lr`` overload): rgpu lifts such a
tensor into a scalar input of the graph, so an LR schedule does not make a new graph every step,
as a float argument (a constant of the graph) would. torch has no Meta kernel for those
overloads; their outputs have the layouts of the lists they update, which the kernels here say.
"""

import functools

import torch

# torch name -> the functional op; its results, in order, replace these positional lists.
_FUSED = {
    "_fused_adamw_": (torch.ops.aten._fused_adamw, 5),
    "_fused_adam_": (torch.ops.aten._fused_adam, 5),
    "_fused_sgd_": (torch.ops.aten._fused_sgd, 3),
    "_fused_adagrad_": (torch.ops.aten._fused_adagrad, 3),
}


def _on_rgpu(tensors):
    return bool(tensors) and tensors[0].device.type == "rgpu"


def _functional_step(original, functional, mutated):
    @functools.wraps(original)
    def step(*args, **kwargs):
        if not _on_rgpu(args[0]):
            return original(*args, **kwargs)
        lr = kwargs.get("lr")
        if isinstance(lr, (int, float)):
            kwargs["lr"] = torch.tensor(float(lr), dtype=torch.float64)
        op = functional.tensor_lr if isinstance(kwargs.get("lr"), torch.Tensor) else functional.default
        results = op(*args, **kwargs)
        for targets, values in zip(args[:mutated], results):
            if targets:
                torch._foreach_copy_(targets, values)

    return step


_meta_lib = None


def _register_tensor_lr_metas():
    global _meta_lib
    _meta_lib = torch.library.Library("aten", "IMPL")
    for functional, mutated in _FUSED.values():
        def meta(*args, _mutated=mutated, **kwargs):
            return tuple([torch.empty_like(t) for t in ts] for ts in args[:_mutated])

        _meta_lib.impl(functional.tensor_lr, meta, "Meta", allow_override=True)


def install():
    if _meta_lib is None:
        _register_tensor_lr_metas()
    for name, (functional, mutated) in _FUSED.items():
        original = getattr(torch, name)
        if not hasattr(original, "__wrapped__"):
            setattr(torch, name, _functional_step(original, functional, mutated))
