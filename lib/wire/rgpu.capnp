# The rgpu wire protocol. One ClientFrame or ServerFrame per frame (see rgpu/net/Frame.h).
#
# Steady state is one ClientFrame per training step carrying a Run (plus any piggybacked
# releases and small uploads). A graph travels in full exactly once, in a Define.
#
# Sequence numbers and acknowledgements exist so that a dropped connection can later be resumed
# without loss: the client numbers every frame, the server acknowledges the last frame it has
# executed in each reply, and Hello carries the session id and the frame to resume from.
@0xc4f1d7a3b2e5a901;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("rgpu::wire");

struct TensorMeta {
  dtype @0 :Int8;
  sizes @1 :List(Int64);
  strides @2 :List(Int64);
}

# A flattened argument: a list arg with count N is followed by its N elements.
struct Arg {
  union {
    none @0 :Void;
    bool @1 :Bool;
    int @2 :Int64;
    double @3 :Float64;
    str @4 :Text;
    device @5 :Text;
    tensor @6 :UInt32;   # index into Node.operands
    scalar @7 :UInt32;   # index into Node.scalars
    list @8 :UInt32;     # element count
  }
}

struct Node {
  op @0 :Text;            # "aten::add.Tensor"
  args @1 :List(Arg);
  operands @2 :List(UInt32);
  scalars @3 :List(UInt32);
  outputs @4 :List(TensorMeta);
  loc @5 :UInt32;         # index into Graph.locations; not hashed
}

struct ScalarSlot {
  dtype @0 :Int8;
  form @1 :ScalarForm;
}

# How a scalar slot's value reaches its op (ir::ScalarForm).
enum ScalarForm {
  scalar @0;              # a Python number in a Scalar argument
  wrappedNumber @1;       # the 0-dim CPU tensor PyTorch makes of a Python number in `x * 2.0`
  tensor0d @2;            # a real 0-dim CPU tensor
  generator @3;           # an int64: the id of a GeneratorRequest's generator, for a
                          # Generator? argument
}

# An integer of a symbolic graph: coef * (product of the symbols named) + offset.
struct SymbolicInt {
  position @0 :UInt64;        # in rgpu/ir/Symbolic.h's forEachPosition order
  coef @1 :Int64;
  offset @2 :Int64;
  factors @3 :List(UInt16);   # at most two
}

struct Graph {
  inputs @0 :List(TensorMeta);
  scalars @1 :List(ScalarSlot);
  nodes @2 :List(Node);
  outputs @3 :List(UInt32);
  locations @4 :List(Text);
  symbolCount @5 :UInt32;     # size symbols; 0 for a static graph
  symbolic @6 :List(SymbolicInt);
}

struct Hash {           # a graph's BLAKE2b-256 digest (ir::Hash256), as four little-endian words
  w0 @0 :UInt64;
  w1 @1 :UInt64;
  w2 @2 :UInt64;
  w3 @3 :UInt64;
}

struct ScalarValue {
  union {
    int @0 :Int64;
    double @1 :Float64;
    bool @2 :Bool;
    complex :group {
      real @3 :Float64;
      imag @4 :Float64;
    }
  }
}

struct Hello {
  protocol @0 :UInt32;
  torchVersion @1 :Text;
  sessionId @2 :Data;     # 16 random bytes chosen by the client: the session can be resumed
                          # under it (by a peer of the same authentication) after a drop
  authMac @3 :Data;       # over TCP: net::auth::clientMac(token, challenge, clientNonce)
  resumeFrom @4 :UInt64;  # 0 starts a new session; else resume sessionId, whose replies the
                          # client has up to frame resumeFrom - 1
  clientNonce @5 :Data;   # 32 random bytes, so that the server's proof is fresh too
}

# The first frame of a TCP connection, sent by the server before it reads anything: a client
# answers it in its Hello (authMac). Unix-socket peers are known by their uid and get none.
struct Challenge {
  nonce @0 :Data;         # 32 random bytes
}

struct Define {
  hash @0 :Hash;
  graph @1 :Graph;
  executor @2 :Executor;
  mode @3 :CompileMode;   # how Inductor compiles and runs it (torch.compile's modes)

  enum Executor {
    serverDecides @0;
    inductor @1;          # compile at the second run (a torch.compile region)
    plan @2;              # never compile
  }

  enum CompileMode {
    serverDecides @0;     # the server's --compile-mode
    standard @1;          # torch.compile's "default"
    reduceOverhead @2;    # replayed as a CUDA graph on a CUDA server
    maxAutotune @3;       # autotuned, and replayed as a CUDA graph
    maxAutotuneNoCudagraphs @4;
  }
}

struct Run {
  hash @0 :Hash;
  firstOutput @1 :UInt64;        # output k binds handle firstOutput + k
  replyMetas @2 :Bool;           # reply with the output metas (data-dependent shapes)
  numOutputs @3 :UInt32;         # lets the server poison the outputs of a graph it refused
  symbols @4 :List(Int64);       # the values of a symbolic graph's size symbols for this run
  # What the run binds (rgpu/wire/RunArgs.h), whole or relative to this session's previous Run
  # of the same graph: a steady training step runs the same graph on the previous step's
  # outputs with mostly the same scalars. Both sides remember each graph's previous run; a
  # Forget drops it.
  union {
    whole :group {
      inputs @5 :List(UInt64);        # handles, in canonical input order
      scalars @6 :List(ScalarValue);  # in canonical slot order
      restores @7 :List(UInt32);      # see below
    }
    relative :group {
      inputDeltas @8 :List(Int64);    # pairs (delta, count): the next count inputs are the
                                      # previous run's handles plus delta
      changedSlots @9 :List(UInt32);  # the scalar slots whose values changed...
      changedValues @10 :List(UInt16); # ...each one's value, an index into values
      values @11 :List(ScalarValue);  # the distinct new values
      restores @12 :List(UInt32);     # absent: those of the previous run
    }
  }
  # restores: a cancelled run binds none of its outputs: each is an error (Error.pythonType
  # "Cancelled"), except those that are a new version of a tensor the user updated in place (a
  # parameter after an optimizer step): pairs (output k, input i) bind output k to input i's
  # tensor, the version from before the run.
}

struct Upload {
  handle @0 :UInt64;
  meta @1 :TensorMeta;
  offset @2 :UInt64;     # byte offset of this chunk
  total @3 :UInt64;      # bytes of the whole tensor
  data @4 :Data;
  device @5 :UInt8;      # rgpu:device, an index into HelloReply.devices
  encoding @6 :Encoding;
  length @7 :UInt64;     # with bytePlanes, the bytes of the chunk that data decodes to
  digest @8 :Hash;       # set on an upload of 1 MiB or more: the BLAKE2b-256 of its total bytes.
                         # The server checks the bytes against it (a mismatch refuses the upload
                         # and stores nothing) and keeps them in its content store, per principal
  stored @9 :Bool;       # with digest, and no data: the bytes are those the principal's store
                         # holds under the digest (Command.hasContent said it does)

  enum Encoding {
    raw @0;              # data is the chunk's bytes
    bytePlanes @1;       # data is them compressed by byte plane (rgpu/wire/Planes.h), elements
                         # of the meta's dtype
  }
}

struct Download {
  handle @0 :UInt64;
  meta @1 :TensorMeta;   # the layout the client wants the bytes in
  offset @2 :UInt64;     # the bytes [offset, offset + length) of that layout; a tensor larger
  length @3 :UInt64;     # than one Data blob (512 MiB) comes in chunks. length 0: all of it
}

struct Command {
  union {
    hello @0 :Hello;
    define @1 :Define;
    run @2 :Run;
    upload @3 :Upload;
    download @4 :Download;
    seed @5 :UInt64;
    sync @6 :Void;
    stats @7 :Void;      # answered with the server's counters
    forget @8 :List(Hash); # graphs this session no longer needs (see HelloReply.graphBudget)
    bye @9 :Void;        # the client is done: end the session now, keep nothing for a resume
    releaseRanges @10 :List(UInt64); # pairs (first, count): releases handles first..first+count-1
    memory @11 :MemoryRequest; # answered with the server device's DeviceMemory
    hostStore @12 :Void;  # start a rendezvous store for a job spread over servers (one
                          # server of the job does); answered with its "host:port" (text)
    joinGroup @13 :JoinGroup; # answered with the group's name for this session's graphs (text)
    rngState @14 :RngStateRequest; # answered with the generator's state (rngState)
    generator @15 :GeneratorRequest; # makes, seeds or drops a generator of this session
    cancel @16 :Void;    # the user interrupted (Ctrl-C, rgpu.cancel()): every Run of this
                         # session's earlier frames is cancelled (see Run.restores). Its frame
                         # has the header flag net::kFlagCancel, so the server's I/O loop sees
                         # it as it arrives, while earlier frames still run
    hasContent @17 :List(Hash); # answered with `present`: which of these digests the content
                                # store holds for this session's principal (at most 4096)
    file @18 :FileRequest; # the server's files area (--files-dir)
  }
}

# The principal's part of the server's files area: `path` is relative to it, with components
# separated by "/", none of them empty, "." or ".."; a symbolic link, a device or any other file
# that is not a regular file or a directory is refused wherever it is met. Failures are the
# session's error, with pythonType FileNotFoundError, FileExistsError, PermissionError,
# IsADirectoryError, NotADirectoryError or OSError.
struct FileRequest {
  path @0 :Text;
  union {
    list @1 :Void;          # answered with `files`: a directory's entries, or the file itself
    read @2 :FileRange;     # answered with `data`: at most Limits.maxReplyDataBytes
    write @3 :FileWrite;
    remove @4 :Void;        # a file, or an empty directory
    tensor @5 :FileTensor;  # binds a handle to a tensor read from the file
    gather @6 :FileGather;  # binds a handle to rows of the file gathered by an index tensor
    saveArchive @7 :List(ArchiveRecord); # writes a torch.save archive (a zip) of these records
    loadArchive @8 :LoadArchive; # reads one: answered with `records`
  }
}

struct FileRange {
  offset @0 :UInt64;
  length @1 :UInt64;
}

# Writes go to "PATH.partial" (made, or grown at its end); `commit` renames it to PATH,
# replacing a file there. An upload that broke off goes on from the partial file's size (`list`).
# A write from offset 0 that commits (a file written in one request) uses a partial file of its
# own instead, so that two writers of one path never mix their bytes.
struct FileWrite {
  offset @0 :UInt64;      # must be the partial file's size (0 starts it over)
  parts @1 :List(FilePart);
  commit @2 :Bool;
  digest @3 :Hash;        # with commit, if set: the BLAKE2b-256 the whole file must have
}

struct FilePart {
  union {
    data @0 :Data;
    tensor @1 :StoredTensor; # a tensor's bytes, in the layout of its meta
  }
}

struct StoredTensor {
  handle @0 :UInt64;
  meta @1 :TensorMeta;    # the layout its bytes are written in (or read as)
}

struct FileTensor {
  handle @0 :UInt64;
  meta @1 :TensorMeta;    # the tensor: its storage is the file's bytes from offset
  offset @2 :UInt64;
  device @3 :UInt8;
}

# out[i...] = row index[i...] of the file's rows: `rows` rows of `rowSizes` elements of `dtype`
# from `offset` (rgpu.data.RemoteArray). An index out of range fails with IndexError.
struct FileGather {
  handle @0 :UInt64;      # the output: index.sizes + rowSizes, of dtype
  index @1 :UInt64;       # an int64 tensor of the session
  dtype @2 :Int8;
  rowSizes @3 :List(Int64);
  rows @4 :UInt64;
  offset @5 :UInt64;
  device @6 :UInt8;
}

struct ArchiveRecord {
  name @0 :Text;          # "data.pkl", "data/0", ... as torch.save names them
  union {
    data @1 :Data;
    tensor @2 :StoredTensor;
  }
}

struct LoadArchive {
  firstHandle @0 :UInt64; # the archive's k-th storage record binds firstHandle + k (a uint8
  device @1 :UInt8;       # tensor on rgpu:device); at most 65536 of them
}

struct FileEntry {
  name @0 :Text;
  size @1 :UInt64;
  directory @2 :Bool;
}

# torch.Generator(device="rgpu"): a generator of this session that random ops given it as
# generator= draw from (a scalar slot of form 3 carries its id in each Run, so one graph serves
# every generator). At most 4096 per session.
struct GeneratorRequest {
  id @0 :UInt64;         # the client's name for it, not 0
  device @1 :UInt8;      # rgpu:device, an index into HelloReply.devices
  union {
    create @2 :UInt64;   # a new generator of the device, seeded with this
    cloneOf @3 :UInt64;  # a new generator in the state generator cloneOf is in
    seed @4 :UInt64;     # manual_seed
    drop @5 :Void;       # the client's Generator is gone
    snapshot @6 :Void;   # a new generator in the state the session's generator of the
                         # device is in: torch.random.fork_rng and torch.utils.checkpoint save
                         # the device's state this way, without a round trip
    restore @7 :Void;    # the session's generator of the device takes this one's state
  }
}

# torch.rgpu.get_rng_state / set_rng_state: the state of this session's generator of a device,
# which every random op without an explicit generator draws from. Ordered with the Runs of the
# frame, as the user's calls are with the ops around them.
struct RngStateRequest {
  device @0 :UInt8;      # rgpu:device, an index into HelloReply.devices
  set @1 :Bool;          # first set the state to `state` (as Generator.set_state checks it)
  state @2 :Data;        # a state that get_rng_state gave, at most 64 KiB
  generator @3 :UInt64;  # 0: the session's generator of the device; else a GeneratorRequest's
}

struct RngState {
  state @0 :Data;        # Generator.get_state(): 5056 bytes on a CPU server, 16 on CUDA
  initialSeed @1 :UInt64; # the seed it was last seeded with (torch.rgpu.initial_seed)
}

# This session joins a torch.distributed process group among the servers of a job (Gloo), as
# rank `rank` of `size`. Graphs then name the group in their _c10d_functional ops by the name
# the reply gives, which belongs to this session only. The server waits for every rank, up to
# timeoutMs.
struct JoinGroup {
  store @0 :Text;        # "host:port" of the job's rendezvous store; "" for the one this
                         # session hosts (hostStore)
  prefix @1 :Text;       # keys of this group in the store (one store serves several groups)
  rank @2 :UInt32;
  size @3 :UInt32;
  timeoutMs @4 :UInt32;
}

# torch.rgpu's memory functions. The figures are the whole server process's, as torch.cuda's
# are the whole process's: on CUDA those of its caching allocator; on a CPU server the bytes
# every session holds (server/Memory.h) and the machine's physical memory.
struct MemoryRequest {
  resetPeak @0 :Bool;    # reset_peak_memory_stats, before the figures are taken
  emptyCache @1 :Bool;   # empty_cache: cached blocks no tensor uses go back to the device
  device @2 :UInt8;      # rgpu:device, an index into HelloReply.devices
}

struct DeviceMemory {
  device @0 :Text;               # "cuda:0", "cpu"
  name @1 :Text;                 # "NVIDIA H200"; a CPU server's processor
  allocated @2 :UInt64;          # bytes in tensors
  allocatedPeak @3 :UInt64;      # since start or the last resetPeak
  reserved @4 :UInt64;           # bytes the allocator holds (cached blocks included)
  reservedPeak @5 :UInt64;
  free @6 :UInt64;               # the device's free bytes, as cudaMemGetInfo says
  total @7 :UInt64;
  multiProcessors @8 :UInt32;    # a CPU server's cores
  major @9 :UInt32;              # compute capability; 0 on a CPU
  minor @10 :UInt32;
}

struct ClientFrame {
  seq @0 :UInt64;        # 1, 2, 3, ... per session; 0 for a Hello, which is not replayed
  wantReply @1 :Bool;    # the client blocks until the ServerFrame for this frame arrives
  commands @2 :List(Command);
  received @3 :UInt64;   # the last frame whose reply the client has: the server forgets replies
}                        # up to it (it keeps later ones for a resume)

struct Error {
  op @0 :Text;           # "aten::index_select" or empty for protocol errors
  message @1 :Text;
  location @2 :Text;     # the user's file:line recorded at trace time
  kind @3 :Kind;
  graph @4 :Hash;        # the graph and node that failed, so the client can name the user's
  node @5 :UInt32;       # line as of its latest run (locations are not part of the hash)
  pythonType @6 :Text;   # the Python exception CPU eager raises for this failure: "IndexError",
                         # "ValueError", "TypeError", "NotImplementedError", "LinAlgError",
                         # "OutOfMemoryError", or empty (RuntimeError); "Cancelled": the value
                         # is that of a run a Cancel stopped (rgpu.Cancelled); any other is
                         # ignored
  enum Kind {
    remote @0;           # an op failed; the session goes on
    protocol @1;         # the frame was malformed; the server closes the connection
    version @2;          # Hello mismatch
    auth @3;             # the peer is not let in: no token, a wrong one, another user
  }
}

struct HelloReply {
  protocol @0 :UInt32;
  torchVersion @1 :Text;
  device @2 :Text;
  compiler @3 :Text;
  serverMac @4 :Data;    # over TCP: net::auth::serverMac(token, challenge, clientNonce)
  graphBudget @5 :UInt64; # bytes of graphs (ir::graphBytes) a session may hold defined at
                          # once; the client Forgets its least recently run graphs to stay
                          # under it, and a Define past it is refused. 0: no limit
  resumed @6 :Bool;       # a resume was asked for and the session was found
  lastSeq @7 :UInt64;     # resumed: the last frame the server executed; the client sends
                          # again every frame after it (and the reply to frame lastSeq, if
                          # the client did not have it, follows this one)
  instance @8 :Data;      # 8 random bytes per server process: a client that cannot resume
                          # tells a restarted server from a session dropped after its grace
  sessionGrace @9 :UInt32; # seconds a disconnected session is kept for a resume
  devices @10 :List(Text); # the server's devices (--devices): rgpu:i runs on devices[i];
                           # `device` is devices[0]
  uploadChunk @11 :UInt64; # the most bytes one Upload may carry for this session (frames in
                           # flight count toward its memory quota); 0: Limits' own
}

struct Result {
  union {
    hello @0 :HelloReply;
    data @1 :Data;                 # a Download's bytes
    metas @2 :List(TensorMeta);    # a Run with replyMetas
    done @3 :Void;                 # a Sync
    stats @4 :ServerStats;         # a Stats
    memory @5 :DeviceMemory;       # a MemoryRequest
    text @6 :Text;                 # a HostStore's address, a JoinGroup's group name
    rngState @7 :RngState;         # a RngStateRequest
    present @8 :List(Bool);        # a HasContent
    files @9 :List(FileEntry);     # a FileRequest's list
    records @10 :List(ArchiveRecord); # a FileRequest's loadArchive: every record that is not a
                                   # storage with its data, every storage with its tensor
  }
}

struct GraphStats {
  hash @0 :Hash;
  nodes @1 :UInt32;
  runs @2 :UInt64;       # by this session
  executeNs @3 :UInt64;  # by this session
  buildNs @4 :UInt64;    # verifying it and building its plan
  executor @5 :Text;     # "plan", "inductor", "plan (inductor compiling)", ...
  compiledRuns @6 :UInt64;  # of this session's runs, those that ran compiled code
  compileNs @7 :UInt64;     # how long its compile took, start to package loaded (0: none)
  cudaGraph @8 :Text;       # in a CUDA-graph mode: "replayed", or why not; else ""
  cudaGraphReplays @9 :UInt64;  # by every session
}

# rgpu.server_stats(): the server's counters. The client turns this struct into a Python dict
# through Cap'n Proto's dynamic API (python/src/_C.cpp), so a new counter is a field here and
# a line in the server that sets it: each field becomes a key in snake_case, a field ending
# in Ns becomes one ending in _ms (milliseconds), a Hash its hex digest, a struct a dict.
struct ServerStats {
  planBuilds @0 :UInt64;
  graphsCached @1 :UInt64;
  graphRuns @2 :UInt64;
  sessions @3 :UInt64;
  compiler @4 :Text;               # the server's --compiler
  inductorCompiles @5 :UInt64;     # finished compiles
  compilesPending @6 :UInt64;      # queued or running
  compileFailures @7 :UInt64;
  diskCacheHits @8 :UInt64;        # packages loaded from --cache-dir instead of compiled
  compiledRuns @9 :UInt64;         # runs of compiled code, all sessions
  connections @10 :UInt64;         # open now, authenticated or not
  connectionsRefused @11 :UInt64;  # closed unserved: limits, failed authentication, timeouts
  memoryHeld @12 :UInt64;          # bytes held by all sessions
  memoryKept @13 :UInt64;          # freed blocks sessions keep for their own reuse
  memoryLimit @14 :UInt64;         # --memory-limit; 0: none
  sessionMemories @15 :List(UInt64); # bytes held by each session, largest first
  planEvictions @16 :UInt64;       # plans dropped from the server's cache (--plan-cache)
  compiledEvictions @17 :UInt64;   # compiled packages unloaded (--compiled-cache)
  diskEvictions @18 :UInt64;       # packages deleted from --cache-dir (--disk-cache)
  compilesDropped @19 :UInt64;     # compiles not queued: the queue was full (--compile-queue)
  sessionsParked @20 :UInt64;      # disconnected sessions kept for a resume (--session-grace)
  resumes @21 :UInt64;             # sessions resumed on a new connection
  sessionsExpired @22 :UInt64;     # parked sessions dropped when their grace passed
  session @23 :SessionStats;       # the asking session's own
  compileNs @24 :UInt64;           # every compile that ended, start to package loaded, summed
  cudaGraphReplays @25 :UInt64;    # compiled runs replayed as CUDA graphs
  cudaGraphCaptures @26 :UInt64;
  uploadBytesDeduplicated @27 :UInt64; # upload bytes the content store supplied, all sessions
  storeBytes @28 :UInt64;          # bytes in the content store, every principal's
  storeEvictions @29 :UInt64;      # entries it dropped to stay under --store-size
  filesBytes @30 :UInt64;          # bytes in the asking principal's files area
  filesQuota @31 :UInt64;          # --files-quota; 0: no files area
}

struct SessionStats {
  graphRuns @0 :UInt64;
  executeNs @1 :UInt64;
  tensors @2 :UInt64;
  compiledRuns @3 :UInt64;
  writesInPlace @4 :UInt64;        # compiled writes into a released input's own buffer
  runsCancelled @5 :UInt64;        # runs a Cancel stopped or skipped
  memory @6 :UInt64;               # bytes this session holds (see server/Memory.h)
  memoryPeak @7 :UInt64;
  memoryQuota @8 :UInt64;          # --session-memory; 0: none
  allocationsRefused @9 :UInt64;   # allocations refused by a quota or limit
  graphBytes @10 :UInt64;          # graphs this session holds defined, in ir::graphBytes
  graphBudget @11 :UInt64;         # --graph-memory
  graphsForgotten @12 :UInt64;     # by this session's Forgets
  graphs @13 :List(GraphStats);    # the graphs this session ran
}

struct ServerFrame {
  ackSeq @0 :UInt64;
  results @1 :List(Result);    # one per Hello, Download, Sync, Stats, MemoryRequest,
                               # RngStateRequest, HostStore, JoinGroup, replyMetas Run,
                               # HasContent and FileRequest list, read and loadArchive, in order
  error @2 :Error;             # the first error since the last reply; absent if none
  notes @3 :List(Text);        # what the server wants the user to know (compiles); logged
  challenge @4 :Challenge;     # only in the first frame of a TCP connection
  heartbeat @5 :Bool;          # sent every half second while the client's frames are being
                               # served: a silent server is a hung or unreachable one
}

# A graph as kept in a graph cache directory (RGPU_CACHE_DIR on the client), one file per hash,
# readable by rgpu-trace-dump.
struct CachedGraph {
  hash @0 :Hash;
  graph @1 :Graph;
  firstSeen @2 :UInt64;  # unix seconds
  runs @3 :UInt64;
  cutAt @4 :Text;        # the user's line whose sync cut this graph
}

# ---- The Inductor compile worker: one job in, one result out (server/inductor_worker.py) ----

struct CompileJob {
  hash @0 :Hash;
  graph @1 :Graph;               # a graph that passed every check of the plan builder
  runOps @2 :List(Text);         # per node, the op to run: a *_copy's view, as the plan runs it
  scalars @3 :List(ScalarValue); # the values of the run that asked for the compile
  device @4 :Text;               # "cpu", "cuda:0"
  mode @5 :Text;                 # "" or a torch.compile mode ("max-autotune", ...)
  package @6 :Text;              # where the worker renames the finished package to
  result @7 :Text;               # where the worker writes its CompileResult
  zeroFill @8 :List(UInt32);     # nodes of the empty family: their outputs are zero-filled
  symbols @9 :List(Int64);       # a symbolic graph's size symbols in that run
}

struct ConstantSlot {
  slot @0 :UInt32;
  value @1 :ScalarValue;
}

struct SymbolRange {
  symbol @0 :UInt32;
  min @1 :Int64;
  max @2 :Int64;                  # -1: unbounded
}

struct SymbolRelation {
  symbol @0 :UInt32;              # symbol == coef * of + offset
  of @1 :UInt32;
  coef @2 :Int64;
  offset @3 :Int64;
}

struct CompileResult {
  union {
    ok :group {
      constants @0 :List(ConstantSlot); # scalar slots compiled as constants, with their values
      fxNodes @1 :UInt32;
      ranges @3 :List(SymbolRange);     # a symbolic graph's sizes the package holds for
      relations @4 :List(SymbolRelation); # and how export tied its symbols together
      writes @5 :List(UInt32);          # pairs (output, input): the package writes that output
    }                                   # into that input's buffer and does not return it
    error @2 :Text;                     # why the compile failed: the graph stays on the plan
  }
}
