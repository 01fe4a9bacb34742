"""Runs PyTorch's OpInfo database on rgpu and on CPU and compares.

    python test/python/opinfo_sweep.py [--dtype float32|bfloat16|int64|bool|...] [--grad]
                                       [--limit-samples N] [--ops name,name] [--check-metas]

With --grad the gradients of the samples' inputs are compared too (the sum of every
differentiable output, backpropagated on each side). With --check-metas every op the tracer
gives to ATen's C++ meta kernels is also run by the dispatcher (torch's Python meta kernels);
where the two disagree, the sample's outputs must have CPU's strides too, and the disagreement
is printed (DISAGREE lines).

Prints one line per failing op with the first error, then the pass rate. Needs an
rgpu-opserver (RGPU_OPSERVER, default 127.0.0.1:9720).
"""

import argparse
import collections
import sys

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

import rgpu  # noqa: F401

# Ops whose results are random or uninitialised: rgpu runs them, but they cannot equal CPU's.
NOT_COMPARABLE = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson", "uniform",
                  "exponential", "geometric", "cauchy", "log_normal", "empty", "new_empty")


def to_rgpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("rgpu").requires_grad_(x.requires_grad)
    if (isinstance(x, str) and x == "cpu") or (isinstance(x, torch.device) and x.type == "cpu"):
        return "rgpu"  # factories: device="cpu" in the sample becomes rgpu
    return x


# Tolerances per dtype: rgpu runs the same kernels, but graphs may order reductions differently.
TOLERANCE = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def to_meta(x):
    return x.detach().to("meta") if isinstance(x, torch.Tensor) else x


def compare(actual, expected, dtype=torch.float32, promised=None):
    """Compares rgpu's results with CPU's. Where CPU's kernel disagrees with the op's meta kernel
    (`promised`: the op run on meta tensors), rgpu gives what the meta kernel promised, as CUDA
    does: CPU's bf16 norm statistics are float32, its empty eval-mode ones are per channel."""
    a_flat, _ = tree_flatten(actual)
    e_flat, _ = tree_flatten(expected)
    p_flat = tree_flatten(promised)[0] if promised is not None else [None] * len(e_flat)
    assert len(a_flat) == len(e_flat), f"{len(a_flat)} outputs, CPU has {len(e_flat)}"
    rtol, atol = TOLERANCE.get(dtype, (1e-4, 1e-5))
    for a, e, p in zip(a_flat, e_flat, p_flat):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.device.type == "rgpu", f"got {type(a)}"
            if isinstance(p, torch.Tensor) and (p.dtype, p.shape) != (e.dtype, e.shape) \
                    and (p.dtype, p.shape) == (a.dtype, a.shape):
                if e.shape != a.shape:
                    continue  # CPU returns none of these values
                e = e.to(a.dtype)
            assert a.dtype == e.dtype, f"dtype {a.dtype}, CPU has {e.dtype}"
            torch.testing.assert_close(a.detach().cpu(), e.detach(), rtol=rtol, atol=atol,
                                       equal_nan=True)
        else:
            assert a == e or (a != a and e != e), f"{a!r} != {e!r}"


def input_grads(out, args):
    """Gradients of the sum of every differentiable output with respect to `args`."""
    outs = [o for o in tree_flatten(out)[0]
            if isinstance(o, torch.Tensor) and o.requires_grad and o.numel()]
    leaves = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
    if not outs or not leaves:
        return []
    loss = sum((o.real if o.is_complex() else o).sum() for o in outs)
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def same_strides(actual, expected):
    """Asserts that every tensor of `actual` has the strides of its CPU counterpart."""
    for a, e in zip(tree_flatten(actual)[0], tree_flatten(expected)[0]):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and e.numel() > 1:
            assert a.stride() == e.stride(), \
                f"meta kernels disagree and rgpu's strides {a.stride()} are not CPU's {e.stride()}"


def sweep(limit_samples=4, only=None, dtype=torch.float32, grad=False, check_metas=False):
    results = collections.OrderedDict()
    disagreements = set()
    for op in op_db:
        if only and op.name not in only:
            continue
        if any(word in op.name for word in NOT_COMPARABLE):
            continue
        if dtype not in op.supported_dtypes("cpu"):
            continue
        if grad and (not op.supports_autograd or dtype not in op.supported_backward_dtypes("cpu")):
            continue
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        try:
            samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))[:limit_samples]
        except Exception:
            continue
        failure = None
        for s in samples:
            try:
                expected = op(s.input, *s.args, **s.kwargs)
                expected_grads = input_grads(expected, (s.input, s.args, s.kwargs)) if grad else []
            except Exception:
                continue
            if check_metas:
                rgpu._C._cpp_meta_disagreements()  # of earlier samples
            try:
                inputs = (tree_map(to_rgpu, s.input), tree_map(to_rgpu, s.args), tree_map(to_rgpu, s.kwargs))
                if isinstance(expected, torch.Tensor) and "device" not in s.kwargs and \
                        not any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                                for t in tree_flatten(inputs)[0]):
                    inputs[2]["device"] = "rgpu"  # a factory called without a device: name it
                actual = op(inputs[0], *inputs[1], **inputs[2])
                try:
                    compare(actual, expected, dtype)
                except AssertionError:
                    promised = op(tree_map(to_meta, s.input), *tree_map(to_meta, s.args),
                                  **tree_map(to_meta, s.kwargs))
                    compare(actual, expected, dtype, promised)
                if check_metas:
                    noted = rgpu._C._cpp_meta_disagreements()
                    if noted:
                        disagreements.update(noted)
                        same_strides(actual, expected)
                if grad:
                    grads = input_grads(actual, inputs)
                    assert len(grads) == len(expected_grads), "a different number of gradients"
                    for g, e in zip(grads, expected_grads):
                        assert (g is None) == (e is None), "a gradient is missing on one side"
                        if e is not None:
                            compare(g, e, dtype)
            except Exception as e:  # noqa: BLE001 - every failure is recorded, never raised
                failure = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
                if isinstance(e, rgpu.SessionLost):
                    raise
                break
        results[key] = failure
    for d in sorted(disagreements):
        print("DISAGREE", d)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit-samples", type=int, default=4)
    p.add_argument("--ops", default="")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16", "complex64", "complex128",
                            "int64", "int32", "int16", "int8", "uint8", "bool"])
    p.add_argument("--grad", action="store_true", help="compare input gradients too")
    p.add_argument("--check-metas", action="store_true",
                   help="check the tracer's C++ meta kernels against the dispatcher's")
    args = p.parse_args()
    rgpu._C._check_cpp_metas(args.check_metas)
    results = sweep(args.limit_samples, set(filter(None, args.ops.split(","))),
                    getattr(torch, args.dtype), args.grad, args.check_metas)
    failed = {k: v for k, v in results.items() if v}
    for k, v in failed.items():
        print(f"FAIL {k}: {v}")
    rate = 100.0 * (len(results) - len(failed)) / max(1, len(results))
    what = args.dtype + (" with gradients" if args.grad else "")
    print(f"opinfo ({what}): {len(results) - len(failed)}/{len(results)} ops pass ({rate:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
