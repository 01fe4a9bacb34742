"""``torch.compile(model, backend="rgpu")``: dynamo's graphs, run on rgpu-opserver.

Dynamo captures the Python program; aot_autograd splits it into a forward and a backward graph
of aten ops. Each of those runs on rgpu tensors as one region: the region's ops are traced like
any other rgpu ops and cut into exactly one rgpu graph at its end, which travels, is cached and
is compiled on the server like a lazy graph (the server compiles it with Inductor at its second
run: the first step of a training loop can trace another graph, once). With ``dynamic=True``
(or sizes dynamo has seen change), the sizes dynamo traced as symbols are declared dynamic
(rgpu.mark_dynamic), so a region ships one symbolic graph, not one per shape. Whatever the user
traced before the region (an optimizer step, say) is cut into its own graph first, so a
region's graph is the same every step after the first.

Every op of a captured graph must be an aten op: the server runs nothing else. A custom op
(``torch.library.custom_op``) raises ``rgpu.UnsupportedOpError`` at compile time, naming it,
rather than failing later on the server.
"""

import torch

from . import UnsupportedOpError, _C
from ._dense_view import TorchSeeingRgpuAsDense

_ALLOWED_NAMESPACES = {"aten"}


def _exempt_rgpu_from_functional_fakification():
    from torch._subclasses import meta_utils

    if not isinstance(meta_utils.torch, TorchSeeingRgpuAsDense):
        meta_utils.torch = TorchSeeingRgpuAsDense(torch)


_exempt_rgpu_from_functional_fakification()


def _where(node):
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File")]
    return f" (at {lines[-1]})" if lines else ""


def check_ops(gm, stage):
    """Raises UnsupportedOpError for the first op in \\p gm that is not an aten op."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise UnsupportedOpError(
                f"torch.compile(backend='rgpu'): the {stage} graph uses {target.name()}, a "
                f"higher-order op that rgpu-opserver cannot run{_where(node)}")
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            # A packet (`torch.ops.ns.op`, no overload) answers attribute lookups with overloads.
            name = target.name() if isinstance(target, torch._ops.OpOverload) else \
                target._qualified_op_name
            if name.split("::")[0] not in _ALLOWED_NAMESPACES:
                raise UnsupportedOpError(
                    f"torch.compile(backend='rgpu'): the {stage} graph calls {name}, which is "
                    f"not an aten op; rgpu-opserver runs aten ops only. Call it outside the "
                    f"compiled function, or write it with aten ops{_where(node)}")


def lower_prims(gm):
    """Rewrites the prims that dynamo leaves in a graph as the aten op that computes the same.
    With dynamic shapes it makes a Python float a graph input and its math tensor ops (Hugging
    Face GPT-2's GELU computes ``math.sqrt(2.0 / math.pi)``), converted with
    ``prims.convert_element_type(x, dtype)``: that is ``aten._to_copy(x, dtype=dtype)``. Any
    other prim stays, for check_ops to name."""
    convert = torch.ops.prims.convert_element_type.default
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is convert:
            x, dtype = node.args
            node.target = torch.ops.aten._to_copy.default
            node.args = (x,)
            node.kwargs = {"dtype": dtype}
            changed = True
    if changed:
        gm.recompile()


def _dynamic_dims(gm):
    """Per placeholder of ``gm``, the dimensions its example value has as symbols (dynamo's
    dynamic shapes), or None."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        dims = [d for d, size in enumerate(getattr(val, "shape", ()))
                if isinstance(size, torch.SymInt)] if isinstance(val, torch.Tensor) else []
        out.append(dims or None)
    return out


def _region(gm, stage, executor):
    lower_prims(gm)
    check_ops(gm, stage)
    dynamic = _dynamic_dims(gm)

    def run(*args):
        # The region's graph is cut on its own, queued, and sent with the next message.
        _C.mark_step(False, f"before a torch.compile {stage} graph", send=False)
        # Sizes dynamo traced as symbols are declared dynamic, so the region's first graph is
        # already its symbolic one: one graph per region, whatever the shapes.
        for arg, dims in zip(args, dynamic):
            if dims and isinstance(arg, torch.Tensor) and arg.device.type == "rgpu":
                _C.mark_dynamic(arg, dims)
        out = gm(*args)
        _C.mark_step(False, f"torch.compile {stage} graph", executor, send=False)
        return out

    from functorch.compile import make_boxed_func

    return make_boxed_func(run)


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_backend(mode=None, compiler="inductor"):
    """A torch.compile backend for rgpu tensors.

    ``compiler="inductor"`` asks the server to compile each graph with Inductor at its second
    run (it runs on the plan executor until the compile is done); ``"plan"`` keeps it on the
    plan executor. ``mode`` is one of torch.compile's modes, which the server compiles these
    graphs in instead of its ``--compile-mode``: ``"reduce-overhead"`` (and ``"max-autotune"``)
    replay a compiled graph as a CUDA graph on a CUDA server; None leaves it to the server.
    """
    if compiler not in ("inductor", "plan"):
        raise ValueError(f"compiler must be 'inductor' or 'plan', not {compiler!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode is not None and compiler == "plan":
        raise ValueError("compiler='plan' never compiles: a mode means nothing to it")
    executor = compiler if mode is None else f"inductor:{mode}"
    from torch._dynamo.backends.common import aot_autograd

    def backend(gm, example_inputs):
        check_ops(gm, "captured")
        return aot_autograd(
            fw_compiler=lambda g, _: _region(g, "forward", executor),
            bw_compiler=lambda g, _: _region(g, "backward", executor),
            inference_compiler=lambda g, _: _region(g, "inference", executor),
        )(gm, example_inputs)

    return backend


def dynamo_backend(gm, example_inputs, mode=None, options=None):
    """The backend that ``backend="rgpu"`` names (an entry point): compile_backend(mode)."""
    return compile_backend(mode=mode)(gm, example_inputs)
