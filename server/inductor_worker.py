"""Compiles one rgpu graph with TorchInductor, ahead of time; run by rgpu-opserver.

    python inductor_worker.py --job JOB
    python inductor_worker.py --serve [--cpu-seconds S]

The server compiles each graph it decides to compile in the background, while the graph keeps
running on the plan executor, under resource limits and a deadline. It keeps one worker warm
(--serve: torch and Inductor imported once), which forks a child per job; --job compiles one
job in this process. JOB is a
Cap'n Proto CompileJob: a graph that passed every check of the server's plan builder, the op
each node runs, the scalar values of the run that asked for the compile, and where to put the
package and the CompileResult. The worker rebuilds the graph as a Python function of aten ops,
exports it (scalars become 0-dim tensor inputs read with `.item()`, so a changing learning rate
never recompiles; a symbolic graph's size symbols become dynamic dimensions, so one package
serves every size) and compiles it with AOTInductor into a package that the server
loads and runs from C++, without Python. The package is written under a temporary name and
renamed, so the cache never holds half an artifact.

The worker imports torch and rgpu_compile_job (the wire format, shipped next to this file), and
nothing of the rgpu client. A job's exit status is 0 on success; otherwise 1, with the reason
in the CompileResult and a traceback on stderr.
"""

import argparse
import os
import re
import sys
import time

# Each compile is its own process; one compile should not fan out over every core while the
# server is training on them.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rgpu_compile_job  # noqa: E402  (next to this file)

class Unsupported(Exception):
    """The graph holds something this compiler does not take; it stays on the plan executor."""


def torch_attribute(kind, name):
    """The torch dtype, layout or memory format a graph's number names (rgpu_compile_job reads
    the op-facts table); Unsupported where rgpu names none."""
    if name is None:
        raise Unsupported(f"a {kind} number rgpu does not name")
    return getattr(torch, name)


def resolve(name):
    """The OpOverload for "aten::add.Tensor"."""
    ns, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    if ns != "aten":
        raise Unsupported(f"{name} is not an aten op")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _type_kind(t):
    """The schema type of an argument with Optional peeled off, as a short kind."""
    while isinstance(t, torch.OptionalType):
        t = t.getElementType()
    text = str(t)
    for kind in ("ScalarType", "Layout", "MemoryFormat", "Generator"):
        if text == kind:
            return kind
    return "other"


class Interpreter:
    """Runs a graph's nodes with aten ops; traced by torch.export to get the FX graph."""

    def __init__(self, graph, device, values, specialized):
        self.graph = graph
        self.device = torch.device(device)
        self.values = values            # the scalar values of the run that asked for a compile
        self.specialized = specialized  # slots compiled as constants, checked at run time
        self.symbols = {}               # unbacked symbol name -> scalar slot
        self.sizes = []                 # this call's size symbols (SymInts while exporting)
        self.steps = []
        for node in graph["nodes"]:
            op = resolve(node["run_op"])
            if torch.Tag.nondeterministic_seeded in op.tags and "never_draws" not in node["facts"]:
                raise Unsupported(f"{node['op']} draws random numbers from the session's generator")
            self.steps.append((op, node))

    def _arg(self, kind, value, type_kind, env, scalars):
        if kind == "none":
            return None
        if kind == "bool":
            return bool(value)
        if kind == "int":
            if type_kind == "ScalarType":
                return torch_attribute("dtype", rgpu_compile_job.dtype_name(value))
            if type_kind == "Layout":
                return torch_attribute("layout", rgpu_compile_job.layout_name(value))
            if type_kind == "MemoryFormat":
                return torch_attribute("memory format",
                                       rgpu_compile_job.memory_format_name(value))
            return value
        if kind == "symint":
            _, coef, offset, factors = value
            out = coef
            for f in factors:
                out = out * self.sizes[f]
            return out + offset
        if kind == "double" or kind == "str":
            return value
        if kind == "device":
            return self.device
        if kind == "tensor":
            return env[value]
        if kind == "scalar":
            return scalars[value]
        raise Unsupported(f"argument kind {kind}")

    def call(self, op, node, env, scalars):
        flat = node["args"]
        pos, kw, at = [], {}, 0
        for schema_arg in op._schema.arguments:
            type_kind = _type_kind(schema_arg.type)
            kind, value = flat[at]
            at += 1
            if kind == "list":
                v = [self._arg(*flat[at + k], type_kind, env, scalars) for k in range(value)]
                at += value
            else:
                v = self._arg(kind, value, type_kind, env, scalars)
            if schema_arg.kwarg_only:
                kw[schema_arg.name] = v
            else:
                pos.append(v)
        if op._schema.name.startswith("aten::_foreach_") and any(
                str(a.type) == "List[number]" for a in op._schema.arguments):
            out = self.unrolled(op, pos, kw)
        else:
            out = op(*pos, **kw)
        if isinstance(out, torch.Tensor) or out is None:
            out = [out]
        flat_out = []
        for o in out:
            flat_out.extend(o if isinstance(o, (list, tuple)) else [o])
        if node["zero_fill"]:
            # The empty family: no session may read memory it did not write.
            flat_out = [o.zero_() if o is not None else o for o in flat_out]
        return flat_out

    @staticmethod
    def unrolled(op, pos, kw):
        """A `_foreach_*` op with a list of symbolic scalars, as one op per tensor: Inductor has no
        kernel for the list form and would call back into ATen for it."""
        name = op._schema.name[len("aten::_foreach_"):]
        single = getattr(torch.ops.aten, name)
        count = len(pos[0])
        out = []
        for k in range(count):
            args = [a[k] if isinstance(a, (list, tuple)) and len(a) == count else a for a in pos]
            if name in ("addcmul", "addcdiv"):
                out.append(single(*args[:3], value=args[3], **kw))
            else:
                out.append(single(*args, **kw))
        return out

    def __call__(self, *args):
        g = self.graph
        env = list(args[:len(g["inputs"])])
        self.sizes = [None] * g["symbol_count"]
        for (i, d), k in size_sources(g).items():
            self.sizes[k] = env[i].shape[d]
        scalars = []
        for slot, ((dtype, form), t) in enumerate(zip(g["scalars"], args[len(g["inputs"]):])):
            # A Python number in a Scalar or wrapped-number position keeps its promotion rules
            # as an unbacked symbolic number; a real 0-dim tensor stays a tensor.
            if form == "tensor_0d":
                scalars.append(t)
            elif slot in self.specialized:
                scalars.append(self.values[slot])
            else:
                v = t.item()
                self.symbols[str(v.node.expr)] = slot
                scalars.append(v)
        for op, node in self.steps:
            outs = self.call(op, node, env, scalars)
            if len(outs) != len(node["outputs"]):
                raise Unsupported(f"{node['op']} returned {len(outs)} values, the graph has "
                                  f"{len(node['outputs'])}")
            env.extend(outs)
        return tuple(env[o] for o in g["outputs"])


class _Module(torch.nn.Module):
    """The graph as a module; each (output, input) of `writes` is written into that input, not
    returned."""

    def __init__(self, interpreter, writes):
        super().__init__()
        self.interpreter = interpreter
        self.writes = dict(writes)

    def forward(self, *args):
        outs = self.interpreter(*args)
        for o, i in self.writes.items():
            args[i].copy_(outs[o])
        return tuple(t for o, t in enumerate(outs) if o not in self.writes)


def written_inputs(graph):
    """[(output, input)]: graph outputs the package writes into the buffer of a graph input
    instead of a new one (a static KV cache's `cache[:, :, i:i + 1] = k` is a slice_scatter of
    the whole cache). The server hands the package an input's own buffer when the client has
    released it and nothing else holds it, else a copy. Only an input read by nothing but the
    op that makes the output and overwrites its first argument (as that argument, with the
    input's layout; the op-facts table's "overwrites_first") and views of the region it
    replaces read only for their layout by a copy into them ("region_view", read by a
    "copies_into_first" op as its first argument): if a compiled run fails after writing, the
    server's rerun on the plan reads the written buffer and still computes the same outputs."""
    n_inputs = len(graph["inputs"])
    uses = {}  # value -> [(node, argument position)], a graph output as (None, -1)
    made_by, outputs_of, value = {}, {}, n_inputs
    for node in graph["nodes"]:
        for pos, (kind, v) in enumerate(node["args"]):
            if kind == "tensor":
                uses.setdefault(v, []).append((node, pos))
        outputs_of[id(node)] = range(value, value + len(node["outputs"]))
        for v in outputs_of[id(node)]:
            made_by[v] = node
        value += len(node["outputs"])
    for v in graph["outputs"]:
        uses.setdefault(v, []).append((None, -1))

    def layout_only(node):
        return "region_view" in node["facts"] and all(
            user is not None and "copies_into_first" in user["facts"] and pos == 0
            for v in outputs_of[id(node)] for user, pos in uses.get(v, []))

    layout = ("sizes", "strides", "dtype")
    writes = []
    for o, v in enumerate(graph["outputs"]):
        node = made_by.get(v)
        if node is None or "overwrites_first" not in node["facts"] or len(node["outputs"]) != 1 or \
                graph["outputs"].count(v) != 1:
            continue
        kind, i = node["args"][0]
        if kind != "tensor" or i >= n_inputs or \
                any(f not in node["outputs"][0] or graph["inputs"][i][f] != node["outputs"][0][f]
                    for f in layout):
            continue
        if all((user is node and pos == 0) or (user is not None and user is not node and
                                                layout_only(user))
               for user, pos in uses.get(i, [])):
            writes.append((o, i))
    return writes


def size_sources(graph):
    """{(input, dim): symbol} for the first input size that is each symbol itself."""
    out, seen = {}, set()
    for i, m in enumerate(graph["inputs"]):
        for d, e in enumerate(m["dims"]):
            if e is not None and e[0] == 1 and e[1] == 0 and len(e[2]) == 1 and e[2][0] not in seen:
                seen.add(e[2][0])
                out[(i, d)] = e[2][0]
    return out


def dynamic_shapes(graph):
    """torch.export's dynamic_shapes for a symbolic graph (None for a static one): each symbol a
    named dimension, shared by every input size that is that symbol. The example sizes are
    those of the run that asked for the compile (every symbol at least 2 and no two equal: the
    server sees to it). Every symbol an argument uses must be some input's size, and an
    input whose layout follows the symbols must be contiguous (the server runs the package only
    on such inputs)."""
    if not graph["symbol_count"]:
        return None
    from torch.export import Dim

    dims = [Dim(f"s{k}", min=2) for k in range(graph["symbol_count"])]
    known = set(size_sources(graph).values())
    for node in graph["nodes"]:
        for kind, value in node["args"]:
            if kind == "symint" and not set(value[3]) <= known:
                raise Unsupported(f"{node['op']} has an argument of a size no input has")
    spec = []
    for m in graph["inputs"]:
        if m["symbolic"] and not m["contiguous"]:
            raise Unsupported("an input whose layout follows the sizes is not contiguous")
        for e in m["dims"]:
            if e is not None and not (e[0] == 1 and e[1] == 0 and len(e[2]) == 1):
                raise Unsupported(f"an input size is the expression {e}")
        spec.append({d: dims[e[2][0]] for d, e in enumerate(m["dims"]) if e is not None} or None)
    return (tuple(spec) + (None,) * len(graph["scalars"]),)


def bounded(bound, infinite):
    """An integer bound of a value range, or `infinite` for an unbounded one."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    if bound in (int_oo, -int_oo, sympy.oo, -sympy.oo):
        return infinite
    return int(bound)


def symbol_ranges(graph, exported):
    """[(symbol, min, max)], the sizes the exported program holds for (max -1 for unbounded),
    and [(symbol, of, coef, offset)], the symbols export tied to another one as symbol == coef
    * of + offset (two of ours it merged: coef 1, offset 0). A symbol export made a constant has
    min == max. A tie the server cannot check (of two symbols, or not linear): Unsupported."""
    import sympy

    if not graph["symbol_count"]:
        return [], []
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    # User inputs come after any lifted parameters; this module has none.
    shapes = [n.meta["val"].shape for n in placeholders[:len(graph["inputs"])]]
    exprs = {}
    for i, m in enumerate(graph["inputs"]):
        for d, e in enumerate(m["dims"]):
            if e is None:
                continue
            got = shapes[i][d]
            got = got.node.expr if isinstance(got, torch.SymInt) else sympy.Integer(got)
            if exprs.setdefault(e[2][0], got) != got:
                raise Unsupported(f"export gave symbol s{e[2][0]} two forms")
    ours, out, relations = {}, [], []  # export's symbol -> the first of ours that is it
    for k, expr in sorted(exprs.items()):
        if expr.is_Integer:
            out.append((k, int(expr), int(expr)))
        elif expr.is_Symbol and expr not in ours:
            ours[expr] = k
            vr = exported.range_constraints.get(expr)
            lo = bounded(vr.lower, 0) if vr is not None else 0
            hi = bounded(vr.upper, -1) if vr is not None else -1
            out.append((k, lo, hi))
    for k, expr in sorted(exprs.items()):
        if expr.is_Integer or ours.get(expr) == k:
            continue
        free = expr.free_symbols
        if len(free) != 1 or next(iter(free)) not in ours:
            raise Unsupported(f"export made symbol s{k} the expression {expr}")
        x = next(iter(free))
        poly = sympy.Poly(expr, x)
        coefs = poly.all_coeffs()
        if poly.degree() != 1 or not all(c.is_Integer for c in coefs):
            raise Unsupported(f"export made symbol s{k} the expression {expr}")
        out.append((k, 0, -1))
        relations.append((k, ours[x], int(coefs[0]), int(coefs[1])))
    return sorted(out), relations


def example_inputs(graph, device):
    """Tensors with the graph's input layouts, and one 0-dim tensor per scalar slot."""
    out = []
    for m in graph["inputs"]:
        dtype = torch_attribute("dtype", m["dtype"])
        out.append(torch.empty_strided(m["sizes"], m["strides"], dtype=dtype,
                                       device=device).zero_())
    for dtype, _form in graph["scalars"]:
        out.append(torch.zeros((), dtype=torch_attribute("dtype", dtype), device="cpu"))
    return tuple(out)


MAX_EXPORTS = 16


def constant_slots(graph):
    """The scalar slots compiled as constants from the start: those of arguments the op-facts
    table says decompositions branch on or Inductor lowers as Python numbers, and every Python
    bool, which Inductor's lowerings take only as a constant (a scatter's
    value, say); a bool has two values, so a graph needs at most the plan for the other one."""
    slots = {slot for slot, (dtype, form) in enumerate(graph["scalars"])
             if dtype == "bool" and form != "tensor_0d"}
    for node in graph["nodes"]:
        op = resolve(node["run_op"])
        at = 0
        for schema_arg in op._schema.arguments:
            kind, value = node["args"][at]
            at += 1 + (value if kind == "list" else 0)
            if kind == "scalar" and rgpu_compile_job.compiled_as_constant(op._schema.name,
                                                                          schema_arg.name):
                slots.add(value)
    return slots


def export(graph, device, values, specialized, writes):
    """Exports the graph, writing its `writes` into their inputs and making constants of the
    scalar slots in \p specialized and of those that control flow depends on. Returns the
    program, the constant slots and, per unbacked symbol's name, the slot it reads."""
    from torch._dynamo.exc import UserError, UserErrorType
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    torch._dynamo.config.capture_scalar_outputs = True
    inputs = example_inputs(graph, device)
    shapes = dynamic_shapes(graph)
    for _ in range(MAX_EXPORTS):
        interpreter = Interpreter(graph, device, values, specialized)
        try:
            with torch.no_grad():
                # Guards on the sizes (a slice that must not be empty, say) become checks in
                # the package, which fail a run outside them; the server reruns it on the plan.
                return torch.export.export(_Module(interpreter, writes), inputs, strict=False,
                                           dynamic_shapes=shapes,
                                           prefer_deferred_runtime_asserts_over_guards=True), \
                    specialized, interpreter.symbols
        except UserError as e:
            # Sizes the graph ties together that the client saw as independent symbols (a mask
            # one longer than the cache it covers): export them tied, as export suggests; the
            # server checks the tie per run (symbol_ranges).
            if e.error_type != UserErrorType.CONSTRAINT_VIOLATION or shapes is None:
                raise
            refined = refine_dynamic_shapes_from_suggested_fixes(e.msg, shapes)
            if refined == shapes:
                raise
            shapes = refined
        except GuardOnDataDependentSymNode as e:
            slots = {interpreter.symbols.get(str(s)) for s in e.cond.free_symbols} - {None}
            if not slots or slots <= specialized:
                raise
            specialized = specialized | slots
    raise Unsupported(f"more than {MAX_EXPORTS} exports to find the constant scalars")


def patch_wrapper(name, make):
    """Replaces AOTInductor's C++ wrapper generator method `name` with `make(original)`, once.
    A torch without it compiles as it would."""
    try:
        from torch._inductor.codegen import cpp_wrapper_cpu
    except ImportError:
        return
    cls = cpp_wrapper_cpu.CppWrapperCpu
    original = getattr(cls, name, None)
    if original is None or getattr(original, "rgpu_patched", False):
        return
    replacement = make(original)
    replacement.rgpu_patched = True
    setattr(cls, name, replacement)


def declare_replaced_symbols():
    """AOTInductor declares, in the package's C++, a size symbol that shape solving replaced by
    another symbol (the deferred runtime asserts still name it), but not one replaced by an
    expression: a dynamic cache one longer than the mask built from a scalar gives s65 = s2 + 1,
    and the C++ fails to compile ('s65' was not declared). This declares those too, once every
    symbol of their expression is. A torch without these internals compiles as it would."""
    try:
        import sympy
        from torch._inductor.codegen.cpp_utils import cexpr
        from torch._inductor.virtualized import V
        from torch.utils._sympy.symbol import SymT, symbol_is_type
    except ImportError:
        return

    def make(original):
        def assign(self, name, value, bound_vars):
            original(self, name, value, bound_vars)
            for src, expr in V.graph.sizevars.shape_env.replacements.items():
                if (isinstance(src, sympy.Symbol) and src not in bound_vars
                        and not symbol_is_type(src, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))
                        and expr.free_symbols
                        and all(s in bound_vars for s in expr.free_symbols)):
                    self.prefix.writeline(f"int64_t {src} = {cexpr(expr)};")
                    bound_vars.add(src)
        return assign

    patch_wrapper("codegen_input_symbol_assignment", make)


def skip_input_checks():
    """AOTInductor writes, into every package's C++, a function per input that checks its dtype,
    sizes, strides and device, run only when AOTI_RUNTIME_CHECK_INPUTS is set: about 40 lines
    per input, half of a training step's wrapper source and of its build time (13.9 s -> 7.8 s
    for a small GPT's step of 137 inputs). The server checks every input itself before a
    compiled run (CompiledGraph::run), so the packages are built without them."""
    def no_checks(self):
        self.prefix.splice_aot("""
            static constexpr bool _check_aoti_runtime_check_inputs_env() { return false; }
            AOTI_NOINLINE static void __check_inputs_outputs(
                AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {}
            """)

    patch_wrapper("generate_input_output_runtime_checks", lambda original: no_checks)


def build_wrapper_beside_kernels():
    """AOTInductor compiles a package's C++ wrapper and then its kernels, one compiler process
    after the other, then links them. This starts the wrapper's compile in the background and
    waits for it after the kernels' compile, so the two run at once (each is one process): for
    a small GPT's graphs the kernels' second beside the wrapper's five. Any other build runs as
    before; a torch without these internals builds as it would."""
    try:
        import threading

        from torch._inductor.codecache import AotCodeCompiler
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:
        return
    if getattr(CppBuilder.build, "rgpu_patched", False):
        return
    state = threading.local()  # inside AotCodeCompiler.compile: None, "wrapper" or (thread, error)
    original_build, original_compile = CppBuilder.build, AotCodeCompiler.compile.__func__

    def build(self):
        pending = getattr(state, "pending", None)
        if pending is None or not self._compile_only:
            return original_build(self)
        if pending == "wrapper":  # the first object compile: the wrapper
            error = []

            def run():
                try:
                    original_build(self)
                except BaseException as e:  # raised in the compiling thread, below
                    error.append(e)
            thread = threading.Thread(target=run, name="rgpu-wrapper-build")
            thread.start()
            state.pending = (thread, error)
            return None
        thread, error = pending  # the second: the kernels, built while the wrapper builds
        state.pending = None
        try:
            original_build(self)
        finally:
            thread.join()
        if error:
            raise error[0]
        return None

    def compile(cls, *args, **kwargs):
        state.pending = "wrapper"
        try:
            return original_compile(cls, *args, **kwargs)
        finally:
            pending, state.pending = state.pending, None
            if isinstance(pending, tuple):
                pending[0].join()

    build.rgpu_patched = True
    CppBuilder.build = build
    AotCodeCompiler.compile = classmethod(compile)


def compile_graph(job):
    """Exports and AOT-compiles the job's graph into job["package"] (atomically). Returns the
    number of FX nodes, the (slot, value) pairs compiled as constants, a symbolic graph's
    ranges and ties (symbol_ranges), and the (output, input) pairs written in place
    (written_inputs)."""
    values = job["values"]
    declare_replaced_symbols()
    skip_input_checks()
    build_wrapper_beside_kernels()
    # A one-row matmul (a decoding step's linear layers) becomes a multiply and a sum that
    # Inductor fuses with its neighbours, instead of a call into the BLAS.
    options = {"post_grad_fusion_options": {"decompose_mm_pass": {}}}
    if job["mode"] in ("max-autotune", "max-autotune-no-cudagraphs"):  # as torch.compile's
        options.update(max_autotune=True, coordinate_descent_tuning=True)
    out_path = job["package"]
    tmp = f"{out_path}.tmp{os.getpid()}.pt2"  # AOTInductor wants the suffix
    specialized = constant_slots(job)
    writes = written_inputs(job)
    for _ in range(MAX_EXPORTS):
        exported, specialized, symbols = export(job, job["device"], values, specialized, writes)
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp,
                                                     inductor_configs=options)
            os.replace(tmp, out_path)
            break
        except Exception as e:
            # Inductor traces the exported program again, and may need to know what export
            # left to a runtime check about a scalar (a mask as long as an arange of a Python
            # int, against a cache's length): that scalar is compiled as a constant too.
            named = {symbols.get(name) for name in re.findall(r"\b(?:u|zuf)\d+\b", str(e))}
            named.discard(None)
            if named <= specialized:
                raise
            specialized = specialized | named
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        raise Unsupported(f"more than {MAX_EXPORTS} compiles to find the constant scalars")
    ranges, relations = symbol_ranges(job, exported)
    return (len(exported.graph.nodes), [(slot, values[slot]) for slot in sorted(specialized)],
            ranges, relations, writes)


def compile_job(path):
    """Compiles the CompileJob in `path`; returns the exit status."""
    job = rgpu_compile_job.read_job(path)
    start = time.time()
    try:
        fx_nodes, constants, ranges, relations, writes = compile_graph(job)
    except Exception as e:  # the server keeps the graph on the plan executor
        import traceback
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        rgpu_compile_job.write_error(job["result"], f"{type(e).__name__}: {first}")
        return 1
    rgpu_compile_job.write_ok(job["result"], constants, fx_nodes, ranges, relations, writes)
    sys.stderr.write(f"compiled {fx_nodes} FX nodes in {time.time() - start:.1f} s; "
                     f"{len(constants)} of {len(job['scalars'])} scalars compiled as constants\n")
    return 0


def run_child(job, log, cpu_seconds):
    """A --serve child: the job alone, its output in `log`, under its CPU limit."""
    import ctypes
    import resource
    import signal
    import traceback
    code = 2
    try:
        os.setpgid(0, 0)  # the server kills the job's whole group at its deadline
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the worker
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
        code = compile_job(job)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def serve(cpu_seconds):
    """--serve: reads jobs from stdin, a line "JOB<tab>LOG" each, and compiles each in a child
    forked for it; says "ready" once imported, then "started PID" and "exited STATUS" or
    "killed SIGNAL" for each job, on stdout."""
    import torch._inductor.compile_fx  # noqa: F401  (what every compile imports, once)
    import torch.export  # noqa: F401
    try:
        # The CPU's vector instruction sets, which Inductor finds by compiling a test program
        # for each (6 s on 2 cores, the first time): found here once, the jobs forked from this
        # process inherit them.
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
        valid_vec_isa_list()
    except Exception:  # a torch without it: each job finds them, as it would
        pass

    def say(line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    say("ready")
    for request in sys.stdin:
        job, log = request.rstrip("\n").split("\t")
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(run_child(job, log, cpu_seconds))
        say(f"started {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"exited {os.WEXITSTATUS(status)}" if os.WIFEXITED(status)
            else f"killed {os.WTERMSIG(status)}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="inductor_worker.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", help="the CompileJob file the server wrote")
    parser.add_argument("--serve", action="store_true", help="stay, compiling the jobs read from "
                        "stdin, each in a child process")
    parser.add_argument("--cpu-seconds", type=int, default=900,
                        help="with --serve, the CPU time of each job")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.cpu_seconds)
        return 0
    if not args.job:
        parser.error("--job or --serve is needed")
    return compile_job(args.job)


if __name__ == "__main__":
    sys.exit(main())
