//===- python/src/_C.cpp - rgpu._C: the Python face of the client ----------===//
//
// Thin bindings: error classes, the user's source line for each traced op, stats, mark_step.
// Everything else is in lib/client.
//
//===----------------------------------------------------------------------===//
#include "rgpu/client/Generator.h"
#include "rgpu/client/InplaceChecks.h"
#include "rgpu/client/MetaKernels.h"
#include "rgpu/client/Session.h"
#include "rgpu/client/Versions.h"
#include "rgpu/wire/Wire.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <capnp/dynamic.h>
#include <capnp/serialize.h>
#include <frameobject.h>

#include <llvm/ADT/DenseMap.h>

#include <atomic>
#include <cctype>
#include <cstring>
#include <unordered_map>

namespace py = pybind11;
using namespace rgpu::client;

namespace {

PyObject *gRemoteError = nullptr;
/// Per wire::Error.pythonType, rgpu.RemoteError's subclass that is also that Python exception.
std::unordered_map<std::string, PyObject *> gRemoteErrors;
PyObject *gSessionLost = nullptr;
PyObject *gAuthError = nullptr;
std::string gSkipPrefixes[2]; // torch's and rgpu's own directories

/// An rgpu error on its way to Python. It is built without the GIL, often with the session
/// lock held; torch's bindings (and ours, through the translator registered below) set the
/// Python exception once the stack has unwound, so no lock is held while the GIL is taken.
struct RgpuError : torch::PyTorchError {
  RgpuError(ErrorKind kind, std::string message, std::string pythonType)
      : PyTorchError(std::move(message)), kind(kind), pythonType(std::move(pythonType)) {}
  PyObject *python_type() override {
    if (kind == ErrorKind::Interrupted) {
      // Python's SIGINT handler (KeyboardInterrupt, or whatever the program installed) runs
      // now, instead of at its next instruction: its exception's class is this one's. Without
      // a signal (rgpu.cancel()), or with a handler that raises nothing: rgpu.Cancelled.
      if (PyErr_CheckSignals() != 0) {
        PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
        PyErr_Fetch(&type, &value, &traceback);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        static PyObject *raised = nullptr; // kept alive while torch raises it
        Py_XDECREF(raised);
        raised = type;
        if (type)
          return type;
      }
      return gRemoteErrors.at(kCancelledType);
    }
    if (kind == ErrorKind::Remote) {
      auto it = gRemoteErrors.find(pythonType);
      return it != gRemoteErrors.end() ? it->second : gRemoteError;
    }
    return kind == ErrorKind::Auth ? gAuthError : gSessionLost;
  }
  ErrorKind kind;
  std::string pythonType;
};

[[noreturn]] void raisePython(ErrorKind kind, const std::string &message,
                              const std::string &pythonType) {
  throw RgpuError(kind, message, pythonType);
}

extern "C" { // frames.c
int rgpu_frames_available(void);
const void *rgpu_frame_top(void);
const void *rgpu_frame_back(const void *frame);
PyCodeObject *rgpu_frame_code(const void *frame);
const void *rgpu_frame_instr(const void *frame);
int rgpu_frame_line(const void *frame);
}

/// Whether \p code is torch's or rgpu's own (its frames are skipped). The GIL is held.
bool isLibraryCode(PyCodeObject *code) {
  const char *file = PyUnicode_AsUTF8(code->co_filename);
  std::string f = file ? file : "";
  for (const std::string &p : gSkipPrefixes)
    if (!p.empty() && f.compare(0, p.size(), p) == 0)
      return true;
  return false;
}

/// The location "file:line" of \p code at \p line. The GIL is held.
uint32_t internLine(PyCodeObject *code, int line) {
  const char *file = PyUnicode_AsUTF8(code->co_filename);
  return Session::get().internLocation(std::string(file ? file : "?") + ":" + std::to_string(line));
}

/// What this thread learnt of the code objects and instructions on its stack: whether each code
/// object is skipped, and the location each instruction interned (a line number is a scan of the
/// code's line table, and its text a string to build and look up). Only this thread touches it.
/// Code objects are kept alive (a reference taken under the GIL, never dropped), so an address
/// is never reused by another code object.
struct FrameCache {
  llvm::DenseMap<PyCodeObject *, bool> skip;
  llvm::DenseMap<std::pair<PyCodeObject *, const void *>, uint32_t> lines;

  /// The skip entry of \p code, made under the GIL (\p gil), or null.
  bool *skipped(PyCodeObject *code, bool gil) {
    auto it = skip.find(code);
    if (it != skip.end())
      return &it->second;
    if (!gil)
      return nullptr;
    Py_INCREF(code);
    return &skip.try_emplace(code, isLibraryCode(code)).first->second;
  }
};
thread_local FrameCache tlsFrames;

/// The user's line from this thread's interpreter frames (frames.c). Without the GIL it reads
/// only what the cache knows, and answers false when a frame on the way is new.
bool frameLocation(uint32_t &id, bool gil) {
  FrameCache &cache = tlsFrames;
  for (const void *f = rgpu_frame_top(); f; f = rgpu_frame_back(f)) {
    PyCodeObject *code = rgpu_frame_code(f);
    bool *skipped = cache.skipped(code, gil);
    if (!skipped)
      return false;
    if (*skipped)
      continue;
    std::pair<PyCodeObject *, const void *> key{code, rgpu_frame_instr(f)};
    auto it = cache.lines.find(key);
    if (it == cache.lines.end()) {
      if (!gil)
        return false;
      it = cache.lines.try_emplace(key, internLine(code, rgpu_frame_line(f))).first;
    }
    id = it->second;
    return true;
  }
  id = 0;
  return true;
}

/// The same through CPython's public API, for versions whose frame layout frames.c does not
/// know. The GIL is held.
uint32_t publicLocation() {
  FrameCache &cache = tlsFrames;
  PyFrameObject *frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  uint32_t id = 0;
  while (frame) {
    PyCodeObject *code = PyFrame_GetCode(frame);
    bool skipped = *cache.skipped(code, true);
    if (!skipped) {
      auto [at, fresh] = cache.lines.try_emplace(
          {code, reinterpret_cast<const void *>(intptr_t(PyFrame_GetLasti(frame)))}, 0);
      if (fresh)
        at->second = internLine(code, PyFrame_GetLineNumber(frame));
      id = at->second;
    }
    Py_DECREF(code);
    PyFrameObject *back = skipped ? PyFrame_GetBack(frame) : nullptr;
    Py_DECREF(frame);
    frame = back;
  }
  return id;
}

/// The last user's line found on any thread: ops traced where no user code runs (autograd's
/// device thread, running a backward) are put on the line that started them.
std::atomic<uint32_t> gLastLocation{0};

uint32_t withFallback(uint32_t id) {
  if (id == 0)
    return gLastLocation.load(std::memory_order_relaxed);
  gLastLocation.store(id, std::memory_order_relaxed);
  return id;
}

/// The innermost frame outside torch and rgpu: the user's line. torch's bindings release the
/// GIL around an op; a loop that runs the same lines again finds them without taking it back.
uint32_t userLocation() {
  if (!Py_IsInitialized())
    return 0;
  uint32_t id = 0;
  if (rgpu_frames_available() && frameLocation(id, false))
    return withFallback(id);
  py::gil_scoped_acquire gil;
  if (rgpu_frames_available())
    frameLocation(id, true);
  else
    id = publicLocation();
  return withFallback(id);
}

} // namespace

namespace {

/// A Cap'n Proto value as Python data, by the rules rgpu.capnp's ServerStats states: structs
/// become dicts keyed by their fields in snake_case, a field ending in Ns one ending in _ms (in
/// milliseconds), a Hash its hex digest. A counter added to the schema reaches Python unnamed
/// here.
py::object toPython(const capnp::DynamicValue::Reader &value);

py::object structToPython(const capnp::DynamicStruct::Reader &s) {
  if (s.getSchema() == capnp::Schema::from<rgpu::wire::Hash>())
    return py::str(rgpu::wire::decodeHash(s.as<rgpu::wire::Hash>()).hex());
  py::dict out;
  for (capnp::StructSchema::Field field : s.getSchema().getFields()) {
    llvm::StringRef camel(field.getProto().getName().cStr());
    std::string key;
    for (char c : camel) {
      if (std::isupper(static_cast<unsigned char>(c))) {
        key += '_';
        c = char(std::tolower(static_cast<unsigned char>(c)));
      }
      key += c;
    }
    capnp::DynamicValue::Reader v = s.get(field);
    if (llvm::StringRef(key).endswith("_ns") && v.getType() == capnp::DynamicValue::UINT) {
      out[py::str(key.substr(0, key.size() - 3) + "_ms")] = double(v.as<uint64_t>()) / 1e6;
      continue;
    }
    out[py::str(key)] = toPython(v);
  }
  return std::move(out);
}

py::object toPython(const capnp::DynamicValue::Reader &value) {
  switch (value.getType()) {
  case capnp::DynamicValue::BOOL: return py::bool_(value.as<bool>());
  case capnp::DynamicValue::INT: return py::int_(value.as<int64_t>());
  case capnp::DynamicValue::UINT: return py::int_(value.as<uint64_t>());
  case capnp::DynamicValue::FLOAT: return py::float_(value.as<double>());
  case capnp::DynamicValue::TEXT: return py::str(value.as<capnp::Text>().cStr());
  case capnp::DynamicValue::STRUCT: return structToPython(value.as<capnp::DynamicStruct>());
  case capnp::DynamicValue::LIST: {
    py::list out;
    for (capnp::DynamicValue::Reader element : value.as<capnp::DynamicList>())
      out.append(toPython(element));
    return std::move(out);
  }
  default: return py::none();
  }
}

/// rgpu.server_stats()'s dict.
py::object capnpToPython(rgpu::wire::ServerStats::Reader stats) {
  return structToPython(capnp::toDynamic(stats));
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rgpu native client";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p)
        std::rethrow_exception(p);
    } catch (RgpuError &e) {
      PyErr_SetString(e.python_type(), e.what());
    }
  });
  m.def("_install", [](py::object remoteError, py::dict remoteErrors, py::object sessionLost,
                       py::object authError, std::string torchDir, std::string rgpuDir) {
    gRemoteError = remoteError.release().ptr();
    for (auto [name, type] : remoteErrors)
      gRemoteErrors[name.cast<std::string>()] = py::reinterpret_borrow<py::object>(type).release().ptr();
    gSessionLost = sessionLost.release().ptr();
    gAuthError = authError.release().ptr();
    gSkipPrefixes[0] = std::move(torchDir);
    gSkipPrefixes[1] = std::move(rgpuDir);
    setErrorRaiser(&raisePython);
    setLocationProvider(&userLocation);
    registerWholeOps();
    checkOutOps();
    trackVersions(); // after checkOutOps, whose kernels it wraps
  });
  m.def("set_server", [](std::string address) {
    Session::Lock lock(Session::get());
    Session::get().setServer(std::move(address));
  });
  m.def("server", []() { return Session::get().server(); });
  m.def(
      "mark_step",
      [](bool wait, std::string reason, std::string executor, bool send) {
        Session::get().markStep(wait, reason.c_str(), executor, send);
      },
      py::arg("wait") = false, py::arg("reason") = "mark_step", py::arg("executor") = "",
      py::arg("send") = true,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "synchronize", []() { Session::get().synchronize(); },
      py::call_guard<py::gil_scoped_release>());
  m.def("seed", [](uint64_t seed) { Session::get().seed(seed); },
        py::call_guard<py::gil_scoped_release>());
  // (state bytes, initial seed) of the session's generator of a device.
  m.def("rng_state", [](int device) {
    rgpu::client::RngState got;
    {
      py::gil_scoped_release release;
      got = Session::get().rngState(device);
    }
    return py::make_tuple(py::bytes(got.state), got.initialSeed);
  });
  // The session's generator of a device saved as an rgpu Generator, or restored from one.
  m.def("rng_snapshot", [](int device) {
    at::Generator g;
    {
      py::gil_scoped_release release;
      g = rgpu::client::RgpuGenerator::snapshot(c10::DeviceIndex(device));
    }
    return py::reinterpret_steal<py::object>(THPGenerator_Wrap(g));
  });
  m.def("rng_restore", [](py::handle g, int device) {
    auto *saved = THPGenerator_Check(g.ptr())
                      ? dynamic_cast<rgpu::client::RgpuGenerator *>(
                            THPGenerator_Unwrap(g.ptr()).unsafeGetGeneratorImpl())
                      : nullptr;
    if (!saved)
      throw py::type_error("expected a torch.Generator of an rgpu device");
    uint64_t id = saved->id();
    py::gil_scoped_release release;
    Session::get().restoreRng(device, id);
  });
  m.def("set_rng_state", [](int device, const std::string &state) {
    Session::get().setRngState(device, state);
  }, py::call_guard<py::gil_scoped_release>());
  auto impl = [](const at::Tensor &t) {
    LazyTensorImpl *i = lazyImpl(t);
    if (!i)
      throw py::value_error("not an rgpu tensor");
    return i;
  };
  m.def("has_value", [impl](const at::Tensor &t) { return Session::get().hasValue(impl(t)); });
  m.def("request_value", [impl](const at::Tensor &t) { Session::get().requestValue(impl(t)); });
  m.def("_set_max_inflight", [](size_t n) {
    Session &session = Session::get();
    Session::Lock lock(session);
    return session.setMaxInflight(n);
  });
  m.def("send", []() { Session::get().send(); }, py::call_guard<py::gil_scoped_release>());
  m.def("cut_before_backward", []() { Session::get().cutBeforeBackward(); },
        py::call_guard<py::gil_scoped_release>());
  m.def("cancel", []() { Session::get().cancel(); }, py::call_guard<py::gil_scoped_release>());
  m.def("_check_replays", [](bool on) {
    Session &session = Session::get();
    Session::Lock lock(session);
    session.setCheckReplays(on);
  });
  m.def("_check_cpp_metas", [](bool on) {
    Session &session = Session::get();
    Session::Lock lock(session);
    rgpu::client::setCheckCppMetas(on);
  });
  m.def("_cpp_meta_ops", &rgpu::client::cppMetaOps);
  m.def("_guard_meta_kernel", [](const std::string &name, const std::string &overload) {
    guardMetaKernel({name, overload});
  });
  // python/rgpu/_meta.py: \p check is torch's Python meta kernel of the in-place op; it runs
  // for signatures not seen before (InplaceChecks.h).
  m.def("_memoize_meta_check", [](const std::string &name, const std::string &overload,
                                  py::object check) {
    auto fn = std::make_shared<py::object>(std::move(check)); // kept for the process's life
    new std::shared_ptr<py::object>(fn); // never destroyed: no GIL is held at exit's teardown
    memoizeMetaCheck({name, overload}, [fn](const c10::OperatorHandle &op, torch::jit::Stack *stack) {
      py::gil_scoped_acquire gil;
      const auto &schema = op.schema();
      const size_t n = schema.arguments().size();
      py::list positional;
      py::dict named;
      auto args = torch::jit::last(*stack, n);
      for (size_t i = 0; i < n; ++i) {
        py::object v = torch::jit::toPyObject(args[i]);
        if (schema.arguments()[i].kwarg_only())
          named[py::str(schema.arguments()[i].name())] = v;
        else
          positional.append(v);
      }
      py::object out = (*fn)(*py::tuple(positional), **named);
      torch::jit::drop(*stack, n);
      const auto &returns = schema.returns();
      if (returns.size() == 1) {
        stack->push_back(torch::jit::toIValue(out, returns[0].type()));
      } else if (returns.size() > 1) {
        py::tuple items = out;
        for (size_t i = 0; i < returns.size(); ++i)
          stack->push_back(torch::jit::toIValue(items[i], returns[i].type()));
      }
    });
  });
  m.def("_cpp_meta_disagreements", [] {
    Session &session = Session::get();
    Session::Lock lock(session);
    return rgpu::client::takeCppMetaDisagreements();
  });
  m.def("set_dynamic", [](bool on) {
    Session &session = Session::get();
    Session::Lock lock(session);
    session.setDynamic(on);
  });
  m.def(
      "mark_dynamic",
      [](const at::Tensor &t, std::vector<int64_t> dims) {
        Session &session = Session::get();
        Session::Lock lock(session);
        LazyTensorImpl *impl = lazyImpl(t);
        if (!impl)
          throw py::value_error("rgpu.mark_dynamic: not an rgpu tensor");
        if (impl->value.pending())
          return false; // not data yet: the hint would have nothing to stay with
        uint64_t mask = 0;
        const int64_t rank = int64_t(impl->value.data->meta.sizes.size());
        for (int64_t d : dims) {
          if (d < -rank || d >= rank)
            throw py::index_error("rgpu.mark_dynamic: dimension " + std::to_string(d) +
                                  " is out of range for a tensor of " + std::to_string(rank) +
                                  " dimension(s)");
          const int64_t dim = d < 0 ? d + rank : d;
          if (dim < 64)
            mask |= uint64_t(1) << dim;
        }
        impl->value.data->dynamicDims |= mask;
        return true;
      },
      py::arg("tensor"), py::arg("dims"));
  m.def("stats", []() {
    const Stats &s = Session::get().counters();
    py::dict d;
    d["messages"] = s.messages.load();
    d["waits"] = s.waits.load();
    d["bytes_out"] = s.bytesOut.load();
    d["bytes_in"] = s.bytesIn.load();
    d["graphs_shipped"] = s.graphsShipped.load();
    d["graph_runs"] = s.graphRuns.load();
    d["ops_traced"] = s.opsTraced.load();
    d["uploads"] = s.uploads.load();
    d["downloads"] = s.downloads.load();
    d["graphs_forgotten"] = s.graphsForgotten.load();
    d["graphs_generalized"] = s.graphsGeneralized.load();
    d["symbolic_runs"] = s.symbolicRuns.load();
    d["cuts_replayed"] = s.cutsReplayed.load();
    d["reads_remembered"] = s.readsRemembered.load();
    d["upload_bytes_saved"] = s.uploadBytesSaved.load();
    d["upload_bytes_deduplicated"] = s.uploadBytesDeduplicated.load();
    d["throttled"] = s.throttled.load();
    d["throttled_ms"] = s.throttledNs.load() / 1e6;
    d["reconnects"] = Session::get().reconnects();
    d["live_tensors"] = Session::get().liveTensors();
    return d;
  });
  m.def("set_log", [](py::object logger, bool debug, uint64_t recompileWarnAfter) {
    static py::object *sinkLogger = new py::object();
    *sinkLogger = logger;
    Session &session = Session::get();
    Session::Lock lock(session);
    session.setLogSink(
        [](int level, const std::string &message) {
          py::gil_scoped_acquire gil;
          try {
            sinkLogger->attr("log")(level, message);
          } catch (py::error_already_set &e) {
            // Ctrl-C while the client waits runs Python's handler in here; its
            // KeyboardInterrupt is made pending again, raised where the user's code resumes.
            if (e.matches(PyExc_KeyboardInterrupt))
              PyErr_SetInterrupt();
            else
              e.discard_as_unraisable("rgpu's log sink");
          }
        },
        debug);
    session.setRecompileWarningThreshold(recompileWarnAfter);
  });
  m.def("close", []() { Session::get().close(); }, py::call_guard<py::gil_scoped_release>());
  m.def("reset", []() { Session::get().reset(); }, py::call_guard<py::gil_scoped_release>());
  m.def("flush_graph_cache", []() { Session::get().flushGraphCache(); },
        py::call_guard<py::gil_scoped_release>());
  m.def("metrics", []() {
    Session &session = Session::get();
    Session::Lock lock(session);
    py::list graphs, sites;
    for (const auto &[hash, g] : session.graphs()) {
      py::dict d;
      d["hash"] = hash.hex();
      d["nodes"] = g.nodes;
      d["runs"] = g.runs;
      d["waited_runs"] = g.waitedRuns;
      d["wait_ms"] = g.waitNs / 1e6;
      d["cut_at"] = g.cutAt;
      d["reason"] = g.reason;
      graphs.append(d);
    }
    for (const auto &[loc, site] : session.sites()) {
      py::dict d;
      d["site"] = session.locationText(loc);
      d["syncs"] = site.syncs;
      d["wait_ms"] = site.waitNs / 1e6;
      d["new_graphs"] = site.newGraphs;
      d["shape_only_graphs"] = site.shapeOnlyGraphs;
      d["symbolic_graphs"] = site.symbolicGraphs;
      d["last_diff"] = site.lastDiff;
      sites.append(d);
    }
    py::dict out;
    out["graphs"] = graphs;
    out["sites"] = sites;
    return out;
  });
  m.def("started", []() { return Session::get().started(); },
        "Whether this process ever started its session on a server.");
  m.def("server_hello", []() {
    rgpu::client::ServerHello h;
    {
      py::gil_scoped_release release;
      h = Session::get().serverHello();
    }
    py::dict out;
    out["protocol"] = h.protocol;
    out["torch"] = h.torchVersion;
    out["device"] = h.device;
    out["compiler"] = h.compiler;
    out["devices"] = h.devices;
    return out;
  });
  m.def("device_count", [] { return Session::get().deviceCount(); },
        py::call_guard<py::gil_scoped_release>());
  m.def("current_device", &rgpu::client::currentDevice);
  m.def("set_device", &rgpu::client::setCurrentDevice);
  // The server waits for every rank of the group: other threads go on meanwhile.
  m.def("host_store", [] { return Session::get().hostStore(); },
        py::call_guard<py::gil_scoped_release>());
  m.def("join_group", [](const std::string &store, const std::string &prefix, int rank, int size,
                         uint32_t timeoutMs) {
    return Session::get().joinGroup(store, prefix, rank, size, timeoutMs);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("device_memory", [](int device, bool resetPeak, bool emptyCache) {
    rgpu::client::DeviceMemory mem;
    {
      py::gil_scoped_release release;
      mem = Session::get().deviceMemory(device, resetPeak, emptyCache);
    }
    py::dict out;
    out["device"] = mem.device;
    out["name"] = mem.name;
    out["allocated"] = mem.allocated;
    out["allocated_peak"] = mem.allocatedPeak;
    out["reserved"] = mem.reserved;
    out["reserved_peak"] = mem.reservedPeak;
    out["free"] = mem.free;
    out["total"] = mem.total;
    out["multi_processors"] = mem.multiProcessors;
    out["major"] = mem.major;
    out["minor"] = mem.minor;
    return out;
  }, py::arg("device") = 0, py::arg("reset_peak") = false, py::arg("empty_cache") = false);
  m.def("server_stats", []() {
    ServerStats stats;
    {
      py::gil_scoped_release release;
      stats = Session::get().serverStats();
    }
    kj::Array<capnp::word> words = kj::heapArray<capnp::word>(stats.message.size() /
                                                              sizeof(capnp::word));
    std::memcpy(words.begin(), stats.message.data(), words.asBytes().size());
    capnp::FlatArrayMessageReader reader(words);
    return capnpToPython(reader.getRoot<rgpu::wire::ServerStats>());
  });
  m.def("download_together",
        [](std::vector<at::Tensor> tensors) { Session::get().downloadTogether(std::move(tensors)); },
        "The first download of any of these tensors fetches them all in one frame; [] ends it.");
  // The server's files area (python/rgpu/remote.py). A part is bytes or an rgpu tensor.
  auto parts = [](const std::vector<py::object> &objects, bool named) {
    std::vector<Session::FilePart> out;
    for (const py::object &o : objects) {
      Session::FilePart p;
      py::object value = o;
      if (named) {
        auto pair = o.cast<py::tuple>();
        p.name = pair[0].cast<std::string>();
        value = pair[1];
      }
      if (THPVariable_Check(value.ptr()))
        p.tensor = THPVariable_Unpack(value.ptr());
      else
        p.data = value.cast<std::string>();
      out.push_back(std::move(p));
    }
    return out;
  };
  m.def("files_list", [](const std::string &path) {
    std::vector<rgpu::client::FileEntry> entries;
    {
      py::gil_scoped_release release;
      entries = Session::get().listFiles(path);
    }
    py::list out;
    for (const auto &e : entries)
      out.append(py::make_tuple(e.name, e.size, e.directory));
    return out;
  });
  m.def("files_read", [](const std::string &path, uint64_t offset, uint64_t length) {
    std::string bytes;
    {
      py::gil_scoped_release release;
      bytes = Session::get().readFile(path, offset, length);
    }
    return py::bytes(bytes);
  });
  m.def("files_write", [parts](const std::string &path, uint64_t offset,
                               const std::vector<py::object> &objects, bool commit,
                               const std::string &digest) {
    std::vector<Session::FilePart> ps = parts(objects, false);
    py::gil_scoped_release release;
    Session::get().writeFile(path, offset, ps, commit, digest);
  });
  m.def("files_remove", [](const std::string &path) { Session::get().removeFile(path); },
        py::call_guard<py::gil_scoped_release>());
  m.def("files_save_archive", [parts](const std::string &path,
                                      const std::vector<py::object> &records) {
    std::vector<Session::FilePart> ps = parts(records, true);
    py::gil_scoped_release release;
    Session::get().saveArchive(path, ps);
  });
  m.def("files_load_archive", [](const std::string &path, int device) {
    std::vector<Session::FilePart> records;
    {
      py::gil_scoped_release release;
      records = Session::get().loadArchive(path, device);
    }
    py::list out;
    for (auto &r : records) {
      if (r.tensor.defined())
        out.append(py::make_tuple(r.name, py::reinterpret_steal<py::object>(THPVariable_Wrap(r.tensor))));
      else
        out.append(py::make_tuple(r.name, py::bytes(r.data)));
    }
    return out;
  });
  m.def("files_tensor", [](const std::string &path, uint64_t offset, at::ScalarType dtype,
                           std::vector<int64_t> sizes, std::vector<int64_t> strides, int device) {
    return Session::get().fileTensor(path, offset, dtype, sizes, strides, device);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("files_gather", [](const std::string &path, uint64_t offset, at::ScalarType dtype,
                           uint64_t rows, std::vector<int64_t> rowSizes, const at::Tensor &index,
                           int device) {
    return Session::get().gatherFile(path, offset, dtype, rows, rowSizes, index, device);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("is_pending", [](const at::Tensor &t) {
    LazyTensorImpl *impl = lazyImpl(t);
    return impl && impl->value.pending();
  });
}
