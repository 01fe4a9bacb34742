"""Runs PyTorch's OpInfo database (float32 samples) on rgpu and on CPU and compares.

    python test/python/opinfo_sweep.py [--limit-samples N] [--ops name,name] [--failures]

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
        return x.to("rgpu")
    if (isinstance(x, str) and x == "cpu") or (isinstance(x, torch.device) and x.type == "cpu"):
        return "rgpu"  # factories: device="cpu" in the sample becomes rgpu
    return x


def compare(actual, expected):
    a_flat, _ = tree_flatten(actual)
    e_flat, _ = tree_flatten(expected)
    assert len(a_flat) == len(e_flat), f"{len(a_flat)} outputs, CPU has {len(e_flat)}"
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.device.type == "rgpu", f"got {type(a)}"
            torch.testing.assert_close(a.cpu(), e, rtol=1e-4, atol=1e-5, equal_nan=True)
        else:
            assert a == e or (a != a and e != e), f"{a!r} != {e!r}"


def sweep(limit_samples=4, only=None):
    results = collections.OrderedDict()
    for op in op_db:
        if only and op.name not in only:
            continue
        if any(word in op.name for word in NOT_COMPARABLE):
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:limit_samples]
        except Exception:
            continue
        failure = None
        for s in samples:
            try:
                expected = op(s.input, *s.args, **s.kwargs)
            except Exception:
                continue
            try:
                actual = op(tree_map(to_rgpu, s.input), *tree_map(to_rgpu, s.args), **tree_map(to_rgpu, s.kwargs))
                compare(actual, expected)
            except Exception as e:  # noqa: BLE001 - every failure is recorded, never raised
                failure = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
                if isinstance(e, rgpu.SessionLost):
                    raise
                break
        results[key] = failure
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit-samples", type=int, default=4)
    p.add_argument("--ops", default="")
    args = p.parse_args()
    results = sweep(args.limit_samples, set(filter(None, args.ops.split(","))))
    failed = {k: v for k, v in results.items() if v}
    for k, v in failed.items():
        print(f"FAIL {k}: {v}")
    rate = 100.0 * (len(results) - len(failed)) / max(1, len(results))
    print(f"opinfo: {len(results) - len(failed)}/{len(results)} ops pass ({rate:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
