"""rgpu: a PyTorch device whose tensors live on a remote GPU.

``import rgpu`` registers the ``rgpu`` device. Every op on an rgpu tensor is traced into a lazy
graph; at a sync point (``.item()``, ``.cpu()``, printing, ``torch.rgpu.synchronize()``, ...)
the graph is cut, hashed, shipped to ``rgpu-opserver`` once and run there. Later steps send only
the hash, the tensor handles and the Python scalar values.

The server address comes from ``RGPU_OPSERVER`` or ``rgpu.set_server(...)``: ``unix:PATH`` or
``host:port``; by default the local server's own Unix socket (see ``rgpu-opserver --help``).
"""

import atexit
import contextvars
import functools
import logging
import os

import torch

__all__ = [
    "Cancelled",
    "RemoteError",
    "SessionLost",
    "AuthenticationError",
    "UnsupportedOpError",
    "cancel",
    "compile_backend",
    "flush",
    "mark_dynamic",
    "mark_step",
    "metrics_report",
    "on_ready",
    "prefetch",
    "remote",
    "reset",
    "server_stats",
    "set_dynamic",
    "set_server",
    "stats",
    "synchronize",
]

logger = logging.getLogger("rgpu")


class RemoteError(RuntimeError):
    """An aten op failed on the server. The message names the op and your source line.

    Where CPU eager raises a more specific exception for the same failure (``IndexError`` for
    an index out of range, ``torch.linalg.LinAlgError``, ``torch.OutOfMemoryError``, ...), the
    error is an instance of that class too, so ``except IndexError:`` catches it as on CPU."""


def _remote_errors():
    """Per Python exception the server may name, RemoteError's subclass that is also one."""
    bases = {"IndexError": IndexError, "ValueError": ValueError, "TypeError": TypeError,
             "NotImplementedError": NotImplementedError,
             "LinAlgError": torch.linalg.LinAlgError, "OutOfMemoryError": torch.OutOfMemoryError,
             # the server's files area (rgpu.remote)
             "FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError,
             "PermissionError": PermissionError, "IsADirectoryError": IsADirectoryError,
             "NotADirectoryError": NotADirectoryError, "OSError": OSError}
    return {name: type(f"Remote{name}", (RemoteError, base),
                       {"__module__": __name__, "__doc__": f"A RemoteError that CPU eager "
                                                           f"raises as {base.__name__}."})
            for name, base in bases.items()} | {"Cancelled": Cancelled}


class Cancelled(RemoteError):
    """The value of a run that was cancelled: Ctrl-C (or ``rgpu.cancel()``) during a wait
    stopped the server's work for this session, and this tensor was not computed. Tensors that
    the cancelled run updated in place (parameters, optimizer state, running statistics) keep
    their values from before it; the session goes on. Raised too by the interrupted wait itself
    when it was interrupted by ``rgpu.cancel()`` (Ctrl-C raises ``KeyboardInterrupt``)."""


class SessionLost(RuntimeError):
    """The session on rgpu-opserver is gone, and with it every rgpu tensor: the server
    restarted, or could not be reached again within RGPU_RECONNECT_SECONDS. A dropped connection
    alone is resumed. ``rgpu.reset()`` starts a new session."""


class AuthenticationError(SessionLost):
    """rgpu-opserver did not let this client in: no token, a wrong one, or another user. The
    message says which token was used and how to get the right one."""


class UnsupportedOpError(RuntimeError):
    """torch.compile(backend="rgpu") met an op that rgpu-opserver cannot run (not an aten op)."""


def compile_backend(mode=None, compiler="inductor"):
    """A torch.compile backend: ``torch.compile(model, backend=rgpu.compile_backend())``.

    ``backend="rgpu"`` is the same with the defaults. See rgpu.backend.
    """
    from .backend import compile_backend as make

    return make(mode=mode, compiler=compiler)


def _check_build() -> None:
    """rgpu's compiled parts work only with the torch release they were built against: say so,
    and what to do, instead of failing on a missing symbol."""
    try:
        from ._build import TORCH_VERSION as built
    except ImportError:
        raise ImportError(
            "rgpu is not built: its compiled parts (rgpu._C, rgpu-opserver) are missing. Build "
            "them with `make` in the checkout, or install with `pip install "
            "--no-build-isolation .`") from None
    release = built.split("+")[0]
    if torch.__version__.split("+")[0] != release:
        raise ImportError(
            f"rgpu was built against torch {built}, and this environment has torch "
            f"{torch.__version__}: its compiled parts work only with torch {release}. Install "
            f"torch=={release}, or rebuild rgpu against this torch (`make` in the checkout, or "
            f"`pip install --no-build-isolation .`).")


_check_build()
torch.utils.rename_privateuse1_backend("rgpu")

from . import _C  # noqa: E402  (the backend must be named before the kernels register)
from . import _ready  # noqa: E402
from ._ready import flush, on_ready, prefetch  # noqa: E402
from . import device as _device_module  # noqa: E402

_C._install(
    RemoteError,
    _remote_errors(),
    SessionLost,
    AuthenticationError,
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(__file__) + os.sep,
)
torch._register_device_module("rgpu", _device_module)

from ._meta import memoize_inplace_meta_checks  # noqa: E402

if torch.distributed.is_available():
    from . import distributed  # noqa: E402,F401  (registers the c10d backend "rgpu")

memoize_inplace_meta_checks()
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=False
)


def _configure_logging():
    # RGPU_LOG=debug shows every cut, graph definition and wait; warnings (recompiles) always go
    # to the "rgpu" logger. A standard logging configuration of that logger works as well.
    level = os.environ.get("RGPU_LOG", "").upper()
    if level:
        logger.setLevel(getattr(logging, level, logging.INFO))
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
            logger.addHandler(handler)
    _C.set_log(logger, logger.isEnabledFor(logging.DEBUG), int(os.environ.get("RGPU_RECOMPILE_WARN", 5)))


_configure_logging()


def _server_for_this_rank():
    # RGPU_OPSERVER="a,b,..." under torchrun: local rank k uses the k-th server.
    servers = os.environ.get("RGPU_OPSERVER", "").split(",")
    if len(servers) > 1:
        rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        if rank >= len(servers):
            raise RuntimeError(f"RGPU_OPSERVER lists {len(servers)} servers, and this is local "
                               f"rank {rank}: list one server per rank of this machine")
        _C.set_server(servers[rank].strip())


_server_for_this_rank()
atexit.register(_C.flush_graph_cache)
# At exit the session ends on the server at once, instead of waiting there for a resume.
atexit.register(_C.close)


def cancel() -> None:
    """Interrupts what rgpu is waiting for, from code, as Ctrl-C does: call it from another
    thread (a timer, a watchdog) while the main thread waits for the server. The wait raises
    ``rgpu.Cancelled`` within ~50 ms, the server stops this session's runs at its next kernel
    (a compiled graph finishes first), and the session goes on. With no wait in progress, the
    work already sent stops the same way. Never blocks."""
    _C.cancel()


def reset() -> None:
    """Starts a new session after ``SessionLost``, without restarting Python: the next rgpu
    operation connects again. Tensors of the old session raise ``SessionLost`` when used."""
    _C.reset()


def set_server(address: str) -> None:
    """Points the client at ``host:port``; takes effect at the first connection."""
    _C.set_server(address)


def set_dynamic(enabled: bool) -> None:
    """Whether graphs that differ only in sizes (a generation loop, the last batch of an epoch)
    run as one graph over size symbols instead of one graph per shape. On unless
    ``RGPU_DYNAMIC=0``; see docs/architecture.md, "Shapes that change"."""
    _C.set_dynamic(enabled)


def mark_dynamic(tensor, dims) -> None:
    """Declares sizes of ``tensor`` dynamic, like ``torch._dynamo.mark_dynamic`` for eager rgpu
    code: the first graph that reads it already runs as a graph over a size symbol for each
    dimension in ``dims`` (an int or a list), instead of waiting to see a second size.
    ``tensor`` must hold data: one moved to rgpu, or any after a sync; a pending one raises
    ValueError. A wrong declaration costs a graph, never a result: a later graph that it does
    not fit is generalized from the sizes seen."""
    if isinstance(dims, int):
        dims = [dims]
    if not _C.mark_dynamic(tensor, list(dims)):
        raise ValueError("rgpu.mark_dynamic: the tensor is not data on the server yet (it "
                         "is the pending result of traced ops); call it on a tensor moved to "
                         "rgpu, or after rgpu.mark_step()")


def stats() -> dict:
    """Client counters since the process started.

    ``messages`` (frames sent), ``waits`` (blocking round trips), ``bytes_out``, ``bytes_in``,
    ``graphs_shipped`` (graphs sent in full), ``graph_runs``, ``ops_traced``, ``uploads``,
    ``downloads``, ``live_tensors``, ``graphs_generalized`` (symbolic graphs made from graphs
    that differed only in sizes), ``symbolic_runs`` (runs of them), ``throttled`` and
    ``throttled_ms`` (times, and how long, the client waited for a server RGPU_MAX_INFLIGHT
    steps behind it; not counted in ``waits``), ``cuts_replayed`` (cuts that
    ran as an earlier cut of the same trace shape resolved, without building their graph).
    """
    return _C.stats()


def mark_step(wait: bool = False) -> None:
    """Cuts the pending trace into a graph and sends it to run, without waiting by default.
    Runs the ``on_ready`` callbacks whose values have arrived."""
    _C.mark_step(wait)
    _ready.deliver()


def server_stats() -> dict:
    """The server's counters since it started, with this session's own under ``session``.

    ``compiler`` ("inductor" or "plan"), ``plan_builds``, ``graphs_cached``, ``graph_runs``,
    ``sessions``, ``inductor_compiles`` (finished), ``compiles_pending`` (queued or running),
    ``compile_failures``, ``compile_ms`` (every compile that ended, from its start to its package
    loaded, summed), ``disk_cache_hits`` (packages loaded from the server's cache instead of
    compiled), ``compiled_runs``; ``connections`` (open now) and ``connections_refused``;
    ``memory_held`` by all sessions against ``memory_limit`` (bytes, 0 for none),
    ``memory_kept`` (blocks sessions freed and keep for their own reuse, counted in no
    session's bytes) and ``session_memories`` (each session's bytes, largest first);
    evictions: ``plan_evictions``, ``compiled_evictions``, ``disk_evictions`` and
    ``compiles_dropped`` (the queue was full).

    ``session`` holds ``graph_runs``, ``compiled_runs``, ``writes_in_place`` (compiled code
    writing a tensor's new value into the buffer of its old one, which the program had let go:
    a static KV cache's update), ``runs_cancelled`` (by Ctrl-C or ``rgpu.cancel()``),
    ``execute_ms`` (running graphs; on a CPU server the time it was busy for this session, so
    ``1 - execute_ms / wall time`` is the share of a loop's time the server waited for the
    client), ``tensors``,
    ``memory`` (bytes held), ``memory_peak``, ``memory_quota`` (0 for none),
    ``allocations_refused``, ``graph_bytes`` held against ``graph_budget``,
    ``graphs_forgotten``, and per graph it holds ``executor``, ``runs``, ``compiled_runs``,
    ``execute_ms``, ``build_ms`` (verifying the graph and building its plan), ``compile_ms``
    (its compile, start to package loaded; 0 if none ended) and, compiled in a CUDA-graph mode
    (reduce-overhead, max-autotune), ``cuda_graph`` ("replayed", or why not) and
    ``cuda_graph_replays``; ``cuda_graph_replays`` and ``cuda_graph_captures`` count them for
    the whole server. One round trip.
    """
    return _C.server_stats()


def metrics_report() -> str:
    """A readable report: client and server counters, graphs with their runs, execute and build
    times, sync sites by wait, and recompiles with their cause. Asks the server (one round trip).
    """
    s = stats()
    m = _C.metrics()
    try:
        server = server_stats()
    except (SessionLost, RuntimeError) as e:
        server = {"unavailable": str(e).splitlines()[0]}
    on_server = {g["hash"]: g for g in server.get("session", {}).get("graphs", [])}
    lines = ["rgpu metrics", "", "client counters:"]
    lines += [f"  {k:16} {v}" for k, v in s.items()]
    lines += ["", "server counters:"]
    lines += [f"  {k:16} {v}" for k, v in server.items() if k != "session"]
    if "session" in server:
        lines += [f"  session {k:8} {v}" for k, v in server["session"].items() if k != "graphs"]
    lines += ["", f"graphs ({len(m['graphs'])}):",
              "  hash          nodes    runs  exec ms/run  wait ms/run  build ms  executor"
              "                   cut at"]
    for g in sorted(m["graphs"], key=lambda g: -g["runs"]):
        wait = g["wait_ms"] / g["waited_runs"] if g["waited_runs"] else 0.0
        sg = on_server.get(g["hash"], {})
        execute = sg["execute_ms"] / sg["runs"] if sg.get("runs") else 0.0
        executor = sg.get("executor", "-") + (" + CUDA graph" if sg.get("cuda_graph") ==
                                              "replayed" else "")
        lines.append(f"  {g['hash'][:12]}  {g['nodes']:5}  {g['runs']:6}  {execute:11.2f}  {wait:11.2f}"
                     f"  {sg.get('build_ms', 0.0):8.2f}  {executor:25}"
                     f"  {g['cut_at'] or '?'}")
    lines += ["", "sync sites (by total wait):", "  syncs  wait ms  site"]
    for site in sorted(m["sites"], key=lambda x: -x["wait_ms"]):
        if site["syncs"]:
            lines.append(f"  {site['syncs']:5}  {site['wait_ms']:7.1f}  {site['site'] or '?'}")
    recompiles = [x for x in m["sites"] if x["new_graphs"] > 1]
    lines += ["", "recompiles (sites that cut more than one graph):"]
    if not recompiles:
        lines.append("  none")
    for site in recompiles:
        cause = "; ".join(site["last_diff"][:3]) or "different ops"
        symbolic = f", {site['symbolic_graphs']} symbolic" if site["symbolic_graphs"] else ""
        lines.append(f"  {site['site'] or '?'}: {site['new_graphs']} graphs "
                     f"({site['shape_only_graphs']} differ only in shapes{symbolic}); "
                     f"latest: {cause}")
    return "\n".join(lines)


def synchronize() -> None:
    """Runs everything traced so far and waits for the server to finish it."""
    _C.synchronize()


def _optimizer_step_boundary(optimizer, args, kwargs):
    # The end of an optimizer step is a natural graph boundary: cutting here (without waiting)
    # keeps a loop that never syncs bounded, and gives graphs that repeat step after step.
    _C.mark_step(False, "optimizer step")
    _ready.deliver()


from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

register_optimizer_step_post_hook(_optimizer_step_boundary)


def _patch_backward():
    # Where a step splits: when autograd's backward starts, the forward traced so far is cut and
    # sent (RGPU_STREAM_CUT ops or more, no wait), so that the server runs it while the backward
    # and the optimizer are traced (docs/architecture.md, "Streamed cuts"). Tensor.backward
    # calls torch.autograd.backward; torch.autograd.grad is the functional form.
    def rgpu_in(tensors):
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        return any(isinstance(t, torch.Tensor) and t.device.type == "rgpu" for t in tensors)

    def streamed(original, first):
        @functools.wraps(original)
        def run(*args, **kwargs):
            tensors = args[0] if args else kwargs.get(first, ())
            if not torch.compiler.is_compiling() and rgpu_in(tensors):
                _C.cut_before_backward()
            return original(*args, **kwargs)

        run.rgpu_streamed = True
        return run

    if not getattr(torch.autograd.backward, "rgpu_streamed", False):
        torch.autograd.backward = streamed(torch.autograd.backward, "tensors")
    if not getattr(torch.autograd.grad, "rgpu_streamed", False):
        torch.autograd.grad = streamed(torch.autograd.grad, "outputs")


_patch_backward()


def _patch_printing():
    # Printing formats with many small ops (slicing, masked_select, ...). Like XLA and lazy
    # tensors, an rgpu tensor is brought to the CPU once and formatted there.
    import torch._tensor_str as ts

    from ._dense_view import TorchSeeingRgpuAsDense

    # The formatter shows a functionalization wrapper as `_to_functional_tensor(...)`; an rgpu
    # tensor prints as a tensor with device='rgpu:0', as a CUDA tensor does.
    if not isinstance(ts.torch, TorchSeeingRgpuAsDense):
        ts.torch = TorchSeeingRgpuAsDense(torch)
    original = ts._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == "rgpu":
            self = self.cpu()
        return original(self, indent)

    ts._tensor_str = _tensor_str


def _patch_copy_into_other_devices():
    # cpu_tensor.copy_(rgpu_tensor) would reach functionalization with a non-functional
    # destination, which it refuses; route it through a download instead.
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if isinstance(src, torch.Tensor) and src.device.type == "rgpu" and self.device.type != "rgpu":
            src = src.to(self.device)
        return original(self, src, non_blocking)

    copy_.__doc__ = original.__doc__
    torch.Tensor.copy_ = copy_


_explicit_inductor = contextvars.ContextVar("rgpu_explicit_inductor", default=False)


def _compile_rgpu_tensors_on_the_server():
    # Plain torch.compile(model) (what nanoGPT's --compile and most tutorials write) on rgpu
    # tensors compiles through the rgpu backend: the server's Inductor. backend="inductor"
    # written out asks for this machine's Inductor, which cannot run rgpu tensors: that is
    # refused, saying what to write. Code without rgpu tensors compiles as it always did.
    original_compile = torch.compile

    @functools.wraps(original_compile)
    def compile(model=None, **kwargs):
        if model is None:  # @torch.compile(...) on a function: the same, once it is given
            return lambda m: compile(m, **kwargs)
        token = _explicit_inductor.set(kwargs.get("backend") == "inductor")
        try:
            return original_compile(model, **kwargs)
        finally:
            _explicit_inductor.reset(token)

    torch.compile = compile
    wrapper = torch._TorchCompileInductorWrapper
    original_init, original_call = wrapper.__init__, wrapper.__call__

    def __init__(self, mode, options, dynamic, *args, **kwargs):
        original_init(self, mode, options, dynamic, *args, **kwargs)
        self._rgpu_explicit = _explicit_inductor.get()
        self._rgpu_mode = mode

    def __call__(self, model_, inputs_, **kwargs):
        if not any(isinstance(t, torch.Tensor) and t.device.type == "rgpu" for t in inputs_):
            return original_call(self, model_, inputs_, **kwargs)
        if getattr(self, "_rgpu_explicit", False):
            raise UnsupportedOpError(
                "torch.compile(backend=\"inductor\") compiles for this machine and cannot run "
                "rgpu tensors; leave backend out (or write backend=\"rgpu\"): rgpu compiles the "
                "graph with Inductor on rgpu-opserver")
        from .backend import compile_backend

        # torch.compile says "default" for no mode at all: the server's --compile-mode then.
        mode = getattr(self, "_rgpu_mode", None)
        return compile_backend(mode=None if mode == "default" else mode)(model_, inputs_)

    wrapper.__init__ = __init__
    wrapper.__call__ = __call__


_patch_printing()
_patch_copy_into_other_devices()
_compile_rgpu_tensors_on_the_server()

from . import _frameworks, _fused, _inplace, _nested, _rng, _transfer  # noqa: E402
from . import backend  # noqa: E402,F401  (dynamo's fake tensors take rgpu parameters as they are)

from . import data  # noqa: E402,F401  (rgpu.data.RemoteArray)
from .remote import remote  # noqa: E402

_transfer.install()
_frameworks.install()
_fused.install()
_rng.install()
_nested.install()
_inplace.install()
