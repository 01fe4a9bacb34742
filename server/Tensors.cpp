//===- server/Tensors.cpp - A session's graphs and tensors -----------------===//
//
// Define and Forget (the graphs a session holds), Run, Upload, Download and Release (the
// tensors bound to its handles).
//
//===----------------------------------------------------------------------===//
#include "Session.h"
#include "ContentStore.h"
#include "Compiler.h"
#include "Device.h"
#include "Policy.h"
#include "Results.h"

#include "rgpu/ir/Digest.h"
#include "rgpu/ir/Error.h"
#include "rgpu/wire/Planes.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace rgpu::server {

void Session::handleDefine(wire::Define::Reader r) {
  ir::Hash256 hash = wire::decodeHash(r.getHash());
  if (defined_.count(hash))
    return;
  const uint64_t budget = ctx_.budgets.graphMemory;
  auto planned = [&]() -> llvm::Expected<std::shared_ptr<const Plan>> {
    ir::Graph graph;
    auto admit = [](llvm::StringRef op) { return policy::admit(op); };
    if (llvm::Error e = wire::decodeGraph(r.getGraph(), ctx_.limits(), graph, admit))
      return std::move(e);
    if (llvm::Error e = groups_.check(graph))
      return std::move(e);
    uint64_t bytes = ir::graphBytes(graph);
    if (budget && graphBytes_ + bytes > budget)
      return failure("its " + memory::sizeText(bytes) + " would take this session past its "
                     "graph memory of " + memory::sizeText(budget) + " (--graph-memory; it "
                     "holds " + memory::sizeText(graphBytes_) + " in " +
                     std::to_string(defined_.size()) + " graphs, and the client forgets the "
                     "least recently run ones to make room)");
    return ctx_.define(hash, std::move(graph));
  }();
  if (planned) {
    std::shared_ptr<const Plan> plan = std::move(*planned);
    defined_[hash] = plan;
    graphBytes_ += plan->bytes;
    refused_.erase(hash);
    // Hints in enumerants this server does not know are ignored, as no hint.
    using Executor = wire::Define::Executor;
    using Mode = wire::Define::CompileMode;
    const char *executor = r.getExecutor() == Executor::INDUCTOR ? "inductor"
                           : r.getExecutor() == Executor::PLAN   ? "plan"
                                                                 : "";
    const char *mode = "";
    switch (r.getMode()) {
    case Mode::STANDARD: mode = "default"; break;
    case Mode::REDUCE_OVERHEAD: mode = "reduce-overhead"; break;
    case Mode::MAX_AUTOTUNE: mode = "max-autotune"; break;
    case Mode::MAX_AUTOTUNE_NO_CUDAGRAPHS: mode = "max-autotune-no-cudagraphs"; break;
    default: break;
    }
    if (ctx_.compiler() && plan->shared)
      ctx_.compiler()->prefer(hash, executor, mode);
    return;
  }
  std::string error = message(planned.takeError());
  log(peer_ + ": refused graph " + hash.hex().substr(0, 12) + ": " + error);
  auto e = sessionError("rgpu-opserver refused the graph: " + error);
  if (refused_.size() >= kMaxRefused) // an earlier refusal's runs then say "unknown graph"
    refused_.erase(refused_.begin());
  refused_[hash] = e;
  fail(e);
}

void Session::handleForget(capnp::List<wire::Hash>::Reader hashes) {
  for (auto h : hashes) {
    ir::Hash256 hash = wire::decodeHash(h);
    auto it = defined_.find(hash);
    if (it == defined_.end())
      continue;
    graphBytes_ -= it->second->bytes;
    defined_.erase(it);
    used_.erase(hash);
    runArgs_.forget(hash);
    ++graphsForgotten_;
  }
}

void Session::handleRun(wire::Run::Reader r, const FrameTail *tail, Reply &reply) {
  std::vector<ir::TensorMeta> metas = run(r, tail);
  if (r.getReplyMetas())
    reply.add(result::Metas{std::move(metas)});
}

std::vector<ir::TensorMeta> Session::run(wire::Run::Reader r, const FrameTail *tail) {
  std::vector<ir::TensorMeta> metas;
  ir::Hash256 hash = wire::decodeHash(r.getHash());
  // Only graphs this session defined: a Run cannot learn whether another session defined one.
  auto defined = defined_.find(hash);
  std::shared_ptr<const Plan> plan = defined == defined_.end() ? nullptr : defined->second;
  uint64_t first = r.getFirstOutput();
  auto poisonAll = [&](ErrorPtr e, size_t count) {
    for (size_t k = 0; k < count; ++k)
      bind(first + k, {at::Tensor(), e});
  };
  if (!plan) {
    // Refused at Define (that error stays with its outputs) or never defined.
    auto refused = refused_.find(hash);
    ErrorPtr e = refused != refused_.end() ? refused->second
                                           : sessionError("unknown graph " + hash.hex());
    fail(e);
    // Without a graph there is no output count to check numOutputs against: poison at most
    // the limit, so a 100-byte Run cannot bind millions of handles.
    poisonAll(e, std::min<uint64_t>(r.getNumOutputs(), ctx_.limits().maxRunOutputs));
    return metas;
  }
  const ir::Graph &g = plan->graph();
  llvm::Expected<wire::RunArgs> args =
      runArgs_.read(hash, r, {g.inputs.size(), g.scalars.size(), g.outputs.size()});
  llvm::Error bad = args.takeError();
  if (!bad && r.getNumOutputs() != g.outputs.size())
    bad = failure("the wrong number of outputs");
  if (bad) {
    auto e = sessionError("run of graph " + hash.hex().substr(0, 12) + ": " +
                          message(std::move(bad)));
    fail(e);
    poisonAll(e, g.outputs.size());
    return metas;
  }
  const std::vector<uint64_t> &handles = args->inputs;
  const std::vector<ir::ScalarValue> &scalars = args->scalars;
  const std::vector<uint32_t> &restores = args->restores;
  // A symbolic graph's layouts and size-derived arguments for this run's sizes.
  Shapes shapes;
  const Shapes *sized = nullptr;
  llvm::SmallVector<int64_t, 4> symbols;
  if (plan->symbolic() || r.getSymbols().size() != 0) {
    for (int64_t v : r.getSymbols())
      symbols.push_back(v);
    ErrorPtr e = plan->symbolic() ? plan->resolve(symbols, shapes)
                                  : sessionError("run of graph " + hash.hex().substr(0, 12) +
                                                 ": size symbols for a static graph");
    if (e) {
      fail(e);
      poisonAll(e, g.outputs.size());
      return metas;
    }
    sized = &shapes;
  }
  std::vector<Entry> inputs;
  inputs.reserve(g.inputs.size());
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    uint64_t h = handles[i];
    auto it = tensors_.find(h);
    if (it == tensors_.end()) {
      auto e = sessionError("unknown tensor handle " + std::to_string(h));
      fail(e);
      poisonAll(e, g.outputs.size());
      return metas;
    }
    Entry in = it->second;
    const ir::TensorMeta &m = sized ? *sized->metas[i] : g.inputs[i];
    if (!in.error && (in.tensor.sizes() != c10::IntArrayRef(m.sizes) ||
                      in.tensor.scalar_type() != bridge::scalarType(m.dtype))) {
      auto e = sessionError("tensor handle " + std::to_string(h) + " does not match input " +
                             std::to_string(i) + " " + m.str());
      fail(e);
      poisonAll(e, g.outputs.size());
      return metas;
    }
    if (!in.error)
      in.tensor = restride(in.tensor, m);
    inputs.push_back(std::move(in));
  }
  if (cancelling()) {
    cancelRun(first, handles, g.outputs.size(), restores,
              std::make_shared<RemoteError>(RemoteError{
                  "", "cancelled (Ctrl-C or rgpu.cancel()) before this graph ran",
                  g.nodes.empty() ? "" : g.locations[g.nodes.back().loc], hash,
                  uint32_t(g.nodes.empty() ? 0 : g.nodes.size() - 1), RemoteError::kCancelled}));
    return metas;
  }
  std::vector<Entry> outputs;
  ++ctx_.graphRuns;
  GraphUse &use = used_[hash];
  use.nodes = g.nodes.size();
  use.buildNs = plan->buildNs;
  use.shared = plan->shared;
  // Compiled code runs only when every input holds a value (the plan propagates errors node by
  // node) and the output layouts are known (not the data-dependent path). Inductor compiles
  // for rgpu:0's device: a graph on another one runs on the plan.
  std::shared_ptr<const CompiledGraph> compiled;
  bool queued = false;
  auto onCompilerDevice = [&] {
    for (uint32_t d = 0; d <= plan->maxDevice; ++d)
      if (ctx_.devices()[d] != ctx_.device())
        return false;
    return std::all_of(inputs.begin(), inputs.end(),
                       [&](const Entry &e) { return e.tensor.device() == ctx_.device(); });
  };
  if (ctx_.compiler() && plan->shared && !r.getReplyMetas() &&
      std::none_of(inputs.begin(), inputs.end(), [](const Entry &e) { return bool(e.error); }) &&
      onCompilerDevice())
    compiled = ctx_.compiler()->lookup(plan, scalars, symbols, inputs, queued);
  auto name = [&] { return "graph " + hash.hex().substr(0, 12); };
  if (queued)
    notes_.push_back(name() + " (" + std::to_string(g.nodes.size()) +
                     " nodes) is compiling with Inductor on the server; until it is ready it "
                     "runs on the plan executor");
  auto start = std::chrono::steady_clock::now();
  bool ran = false;
  if (compiled) {
    // An input the compiled code writes, released later in this frame with nothing reading it
    // in between, is released now: its buffer can take the write if nothing else holds it (an
    // input given twice holds it twice: CompiledGraph::run counts references).
    if (tail)
      for (auto [o, i] : compiled->writes())
        if (tail->frees(handles[i]))
          release(handles[i]);
    try {
      compiled->run(*plan, inputs, scalars, outputs, sized, &writesInPlace_);
      ran = true;
      ++ctx_.compiledRuns;
      ++compiledRuns_;
      if (use.compiledRuns++ == 0)
        notes_.push_back(name() + " now runs Inductor-compiled code");
    } catch (const std::exception &e) {
      // Rerun on the plan, which names the failing op and the user's line.
      const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
      log(peer_ + ": " + name() + ": compiled run failed (" +
          (ce ? ce->what_without_backtrace() : e.what()) + "); running it on the plan executor");
    }
  }
  if (!ran) {
    ErrorPtr e = plan->run(inputs, scalars,
                           {ctx_.devices(), generators_, &explicitGenerators_,
                            [this] { return cancelling(); }},
                           outputs, !r.getReplyMetas(), sized);
    if (e && e->cancelled()) {
      cancelRun(first, handles, g.outputs.size(), restores, e);
      return metas;
    }
    if (e)
      fail(e);
  }
  uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - start).count();
  ++use.runs;
  use.executeNs += ns;
  ++runs_;
  executeNs_ += ns;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (r.getReplyMetas()) {
      ir::TensorMeta m;
      if (outputs[k].tensor.defined())
        m = bridge::metaOf(outputs[k].tensor);
      metas.push_back(std::move(m));
    }
    bind(first + k, std::move(outputs[k]));
  }
  return metas;
}

void Session::cancelRun(uint64_t first, llvm::ArrayRef<uint64_t> inputs, size_t outputs,
                        llvm::ArrayRef<uint32_t> restores, ErrorPtr why) {
  // RunArgsReader checked the pairs against the graph, run() that every input is bound.
  std::vector<Entry> bound(outputs, Entry{at::Tensor(), why});
  for (size_t k = 0; k + 1 < restores.size(); k += 2)
    if (auto it = tensors_.find(inputs[restores[k + 1]]); it != tensors_.end())
      bound[restores[k]] = it->second;
  for (size_t k = 0; k < outputs; ++k)
    bind(first + k, std::move(bound[k]));
  ++runsCancelled_;
}

void Session::handleUpload(wire::Upload::Reader r) {
  uint64_t handle = r.getHandle();
  ir::TensorMeta meta;
  auto data = r.getData();
  const uint64_t total = r.getTotal(), offset = r.getOffset();
  // The bytes this chunk brings: data itself, or what it decodes to (rgpu/wire/Planes.h).
  const bool packed = r.getEncoding() == wire::Upload::Encoding::BYTE_PLANES;
  const uint64_t length = packed ? r.getLength() : data.size();
  auto found = partial_.find(handle);
  Partial *earlier = found == partial_.end() ? nullptr : found->second.get();
  // Exact bounds that cannot wrap, and every chunk after the first agrees with it on meta and
  // total (the buffer was allocated for the first).
  std::string why;
  if (!wire::decodeMeta(r.getMeta(), meta) || meta.storageBytes() < 0)
    why = "its tensor meta is malformed";
  else if (r.getDevice() >= ctx_.devices().size())
    why = "it names rgpu:" + std::to_string(r.getDevice()) + ", and this server has " +
          std::to_string(ctx_.devices().size()) + " device(s)";
  else if (uint64_t(meta.storageBytes()) > ctx_.limits().maxTensorBytes)
    why = "its " + std::to_string(meta.storageBytes() >> 20) +
          " MiB are more than this server's limit per tensor";
  else if (uint64_t(meta.storageBytes()) != total)
    why = "its total of " + std::to_string(total) + " bytes is not its meta's " +
          std::to_string(meta.storageBytes());
  else if (!packed && r.getEncoding() != wire::Upload::Encoding::RAW)
    why = "its encoding " + std::to_string(uint16_t(r.getEncoding())) + " is unknown";
  else if (packed && length > ctx_.limits().uploadChunkBytes)
    why = "its chunk decodes to " + std::to_string(length) + " bytes, more than a chunk's " +
          std::to_string(ctx_.limits().uploadChunkBytes);
  else if (offset > total || length > total - offset)
    why = "its chunk at offset " + std::to_string(offset) + " of " + std::to_string(length) +
          " bytes ends past the total";
  else if (offset != 0 && (!earlier || !(earlier->meta == meta) || earlier->device != r.getDevice()))
    why = "a chunk at offset " + std::to_string(offset) +
          (earlier ? " disagrees with the first chunk's meta or device"
                   : " came without a first chunk");
  else if (offset != 0 && offset != earlier->received)
    why = "its chunk at offset " + std::to_string(offset) + " does not follow the " +
          std::to_string(earlier->received) + " bytes received"; // chunks cover every byte once
  else if (r.getStored() && (!r.hasDigest() || offset != 0 || data.size() || packed))
    why = "a stored upload is one chunk with a digest and no data";
  auto refuse = [&] {
    partial_.erase(handle);
    auto e = sessionError("malformed upload for handle " + std::to_string(handle) + ": " + why);
    fail(e);
    bind(handle, {at::Tensor(), e});
  };
  if (!why.empty())
    return refuse();
  auto &part = partial_[handle];
  if (offset == 0) {
    part = std::make_unique<Partial>();
    part->meta = meta;
    part->device = r.getDevice();
    try {
      part->cpu = at::empty_strided(meta.sizes, meta.strides,
                                    at::TensorOptions()
                                        .dtype(bridge::scalarType(meta.dtype))
                                        .pinned_memory(device::pinned(ctx_.devices()[part->device])));
    } catch (const c10::Error &e) {
      // Over a quota, or out of memory: the upload's chunks are taken and dropped, and its
      // handle holds the error; the session goes on.
      part->error = sessionError("upload of " + memory::sizeText(total) + " for handle " +
                                     std::to_string(handle) + ": " + e.what_without_backtrace(),
                                 pythonTypeOf(e));
      fail(part->error);
    }
  }
  if (r.getStored()) {
    // The bytes are the principal's store's (Command.hasContent said it holds them).
    const ir::Hash256 digest = wire::decodeHash(r.getDigest());
    if (!part->error && !ctx_.store().read(principal_, digest, part->cpu.data_ptr(), total)) {
      why = "the content store holds no " + std::to_string(total) + " bytes under digest " +
            digest.hex() + " for this principal (dropped since the client asked?)";
      return refuse();
    }
    ctx_.uploadBytesDeduplicated += total;
    part->received = total;
  } else if (length && !part->error) {
    auto *at = static_cast<uint8_t *>(part->cpu.data_ptr()) + offset;
    if (!packed) {
      std::memcpy(at, data.begin(), length);
    } else if (!wire::decodePlanes(data.begin(), data.size(), at, length,
                                   ir::dtype::itemSize(meta.dtype), why)) {
      return refuse();
    }
  }
  part->received += length;
  if (part->received < r.getTotal())
    return;
  if (part->error) {
    bind(handle, {at::Tensor(), part->error});
    partial_.erase(handle);
    return;
  }
  if (r.hasDigest() && !r.getStored()) {
    // Named by their content: kept for the principal's next upload of the same bytes, once
    // they are checked against the name.
    const ir::Hash256 digest = wire::decodeHash(r.getDigest());
    if (ir::digestOf(part->cpu.data_ptr(), total) != digest) {
      why = "its " + std::to_string(total) + " bytes do not match the digest sent with them";
      return refuse();
    }
    ctx_.store().put(principal_, digest, part->cpu.data_ptr(), total);
  }
  Entry e;
  try {
    const at::Device &dev = ctx_.devices()[part->device];
    e.tensor = dev.is_cpu() ? part->cpu : device::toDevice(part->cpu, dev);
  } catch (const c10::Error &err) { // CUDA out of memory
    e.error = sessionError("upload of " + memory::sizeText(total) + " for handle " +
                               std::to_string(handle) + ": " + err.what_without_backtrace(),
                           pythonTypeOf(err));
    fail(e.error);
  }
  partial_.erase(handle);
  bind(handle, std::move(e));
}

void Session::handleDownload(wire::Download::Reader r, Reply &reply) {
  // The result comes first: a download that fails is answered empty, and the error says why.
  kj::Array<kj::byte> &bytes = reply.add(result::Data{}).bytes;
  if (ErrorPtr e = download(r, ctx_.limits().maxReplyDataBytes - reply.downloadBytes, bytes))
    fail(std::move(e));
  reply.downloadBytes += bytes.size();
}

ErrorPtr Session::download(wire::Download::Reader r, uint64_t room, kj::Array<kj::byte> &bytes) {
  uint64_t handle = r.getHandle();
  auto it = tensors_.find(handle);
  if (it == tensors_.end()) {
    return sessionError("download of unknown tensor handle " + std::to_string(handle));
  }
  if (it->second.error)
    return it->second.error;
  ir::TensorMeta meta;
  const at::Tensor &t = it->second.tensor;
  if (!wire::decodeMeta(r.getMeta(), meta) || t.sizes() != c10::IntArrayRef(meta.sizes) ||
      t.scalar_type() != bridge::scalarType(meta.dtype)) {
    return sessionError("download of handle " + std::to_string(handle) +
                        " asks for a layout that does not match the tensor");
  }
  const uint64_t total = meta.storageBytes(), offset = r.getOffset();
  const uint64_t length = r.getLength() ? r.getLength() : total - std::min(offset, total);
  if (offset > total || length > total - offset || length > ctx_.limits().maxDownloadBytes) {
    return sessionError("download of handle " + std::to_string(handle) + " asks for bytes [" +
                        std::to_string(offset) + ", +" + std::to_string(length) +
                        ") outside its " + std::to_string(total) + " bytes or above one chunk");
  }
  if (length > room) {
    return sessionError("download of handle " + std::to_string(handle) +
                        " would take this reply past " +
                        std::to_string(ctx_.limits().maxReplyDataBytes >> 20) +
                        " MiB of tensor data; ask for it in another frame");
  }
  // The tensor in the wanted layout on the CPU: the stored tensor itself when it already is
  // that (not a ZeroTensor, which autograd makes for zero gradients: it has no storage), else
  // a copy, staged while its chunks are read.
  at::Tensor cpu;
  if (t.device().is_cpu() && t.strides().equals(meta.strides) && t.storage_offset() == 0 &&
      !t.is_conj() && !t.is_neg() && !t._is_zerotensor() && t.is_non_overlapping_and_dense() &&
      t.has_storage() && t.const_data_ptr()) {
    cpu = t;
  } else if (staged_.defined() && stagedHandle_ == handle && offset != 0) {
    cpu = staged_;
  } else {
    cpu = at::empty_strided(meta.sizes, meta.strides,
                            at::TensorOptions().dtype(t.scalar_type()).pinned_memory(device::pinned(t.device())));
    if (t.device().is_cpu())
      cpu.copy_(t);
    else
      device::toHost(t, cpu);
    if (offset + length < total) {
      stagedHandle_ = handle;
      staged_ = cpu;
    }
  }
  if (offset + length >= total && stagedHandle_ == handle)
    staged_ = at::Tensor();
  bytes = kj::heapArray<kj::byte>(length);
  if (length)
    std::memcpy(bytes.begin(), static_cast<const char *>(cpu.data_ptr()) + offset, length);
  return nullptr;
}

void Session::bind(uint64_t handle, Entry e) {
  auto [it, fresh] = tensors_.try_emplace(handle);
  if (fresh) {
    // Every handle is charged, a poisoned one too: a Run of a graph the session lacks binds
    // thousands of them for a few bytes of frame.
    try {
      if (tensors_.size() > ctx_.budgets.maxHandles)
        throw SessionError("it holds " + std::to_string(ctx_.budgets.maxHandles) +
                           " tensor handles, the most a session may (--max-handles)");
      memory::charge(account_.get(), kHandleBytes);
    } catch (const std::exception &ex) {
      tensors_.erase(it);
      const c10::Error *ce = dynamic_cast<const c10::Error *>(&ex);
      throw SessionError("binding tensor handle " + std::to_string(handle) + ": " +
                         (ce ? ce->what_without_backtrace() : ex.what()));
    }
  }
  it->second = std::move(e);
  if (handle == stagedHandle_)
    staged_ = at::Tensor();
}

void Session::release(uint64_t handle) {
  if (tensors_.erase(handle))
    memory::credit(account_.get(), kHandleBytes);
  if (handle == stagedHandle_)
    staged_ = at::Tensor();
}

void Session::handleReleaseRanges(capnp::List<uint64_t>::Reader ranges) {
  if (llvm::Error bad = wire::checkReleaseRanges(ranges, ctx_.limits().maxReleaseHandles))
    throw ProtocolError{message(std::move(bad))};
  for (size_t k = 0; k < ranges.size(); k += 2)
    for (uint64_t h = ranges[k], end = ranges[k] + ranges[k + 1]; h != end; ++h)
      release(h);
}

bool Session::FrameTail::frees(uint64_t handle) const {
  for (size_t k = lastRun + 1; k < commands.size(); ++k) {
    auto c = commands[k];
    if (c.isDownload() && c.getDownload().getHandle() == handle)
      return false;
    if (c.isReleaseRanges()) {
      auto r = c.getReleaseRanges();
      for (size_t i = 0; i + 1 < r.size(); i += 2)
        if (handle - r[i] < r[i + 1])
          return true;
    }
  }
  return false;
}

} // namespace rgpu::server
