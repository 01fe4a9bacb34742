//===- server/FileCommands.cpp - The content store and the files area, for a session -===//
//
// HasContent asks which uploads the principal's store holds (Tensors.cpp binds them); a
// FileRequest reads, writes, lists or removes a file of the principal's files area (Files.h),
// or moves tensors between its files and the session: a tensor read from a file, rows of a
// file gathered by an index tensor (rgpu.data.RemoteArray), a torch.save archive written from
// the session's tensors or read into them. Tensor bytes never cross the link here.
//
//===----------------------------------------------------------------------===//
#include "ContentStore.h"
#include "Device.h"
#include "Files.h"
#include "Results.h"
#include "Session.h"

#include "rgpu/bridge/Bridge.h"
#include "rgpu/ir/Digest.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <cerrno>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

namespace rgpu::server {

namespace {
/// The most digests one HasContent may ask about.
constexpr size_t kMaxDigests = 4096;
/// The most storages of one archive (LoadArchive.firstHandle's block), and of other records.
constexpr size_t kMaxStorages = 1 << 16, kMaxArchiveRecords = kMaxStorages + 64;

/// Reads \p n bytes at \p offset of \p fd into \p out; a FileError naming \p path if it cannot.
void readAt(int fd, uint64_t offset, void *out, uint64_t n, const std::string &path) {
  auto *at = static_cast<char *>(out);
  uint64_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd, at + done, n - done, off_t(offset + done));
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      throw FileError("files area: '" + path + "' cannot be read" +
                          (got < 0 ? std::string(" (") + std::strerror(errno) + ")"
                                   : ": it is shorter than it was"),
                      "OSError");
    done += uint64_t(got);
  }
}

/// A file of the files area as PyTorchStreamReader reads it.
class FileAdapter final : public caffe2::serialize::ReadAdapterInterface {
public:
  FileAdapter(int fd, uint64_t size) : fd_(fd), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void *buf, size_t n, const char *) const override {
    if (pos >= size_)
      return 0;
    n = std::min<uint64_t>(n, size_ - pos);
    size_t done = 0;
    while (done < n) {
      ssize_t got = ::pread(fd_, static_cast<char *>(buf) + done, n - done, off_t(pos + done));
      if (got < 0 && errno == EINTR)
        continue;
      if (got <= 0)
        break;
      done += size_t(got);
    }
    return done;
  }

private:
  int fd_;
  uint64_t size_;
};

/// A read-only mapping of a whole file, unmapped with it.
struct Mapping {
  void *at = MAP_FAILED;
  uint64_t size = 0;
  ~Mapping() {
    if (at != MAP_FAILED)
      ::munmap(at, size);
  }
};

[[noreturn]] void refuse(const std::string &what, const std::string &pythonType = "ValueError") {
  throw FileError("files area: " + what, pythonType);
}
} // namespace

void Session::handleHasContent(capnp::List<wire::Hash>::Reader digests, Reply &reply) {
  std::vector<bool> &present = reply.add(result::Present{}).present;
  if (digests.size() > kMaxDigests)
    throw SessionError("a HasContent of " + std::to_string(digests.size()) +
                       " digests, more than " + std::to_string(kMaxDigests));
  for (auto d : digests)
    present.push_back(ctx_.store().has(principal_, wire::decodeHash(d)));
}

const at::Tensor &Session::tensorOf(uint64_t handle, const char *what) {
  auto it = tensors_.find(handle);
  if (it == tensors_.end())
    throw SessionError(std::string(what) + ": unknown tensor handle " + std::to_string(handle));
  if (it->second.error)
    throw SessionError(std::string(what) + ": " + it->second.error->message);
  return it->second.tensor;
}

at::Tensor Session::onDevice(const at::Tensor &host, uint8_t device) {
  const at::Device &dev = ctx_.devices()[device];
  return dev.is_cpu() ? host : device::toDevice(host, dev);
}

namespace {
/// The bytes of \p t in the layout \p m (its dtype and sizes, any strides) on the CPU.
at::Tensor hostBytes(const at::Tensor &t, wire::TensorMeta::Reader m, const char *what) {
  ir::TensorMeta meta;
  if (!wire::decodeMeta(m, meta) || t.sizes() != c10::IntArrayRef(meta.sizes) ||
      t.scalar_type() != bridge::scalarType(meta.dtype))
    throw SessionError(std::string(what) + ": the layout asked for does not match the tensor");
  at::Tensor host = at::empty_strided(
      meta.sizes, meta.strides,
      at::TensorOptions().dtype(t.scalar_type()).pinned_memory(device::pinned(t.device())));
  if (t.device().is_cpu())
    host.copy_(t);
  else
    device::toHost(t, host);
  return host;
}
} // namespace

void Session::handleFile(wire::FileRequest::Reader r, Reply &reply) {
  if (r.getPath().size() > FilesArea::kMaxPath)
    refuse("a path of " + std::to_string(r.getPath().size()) + " bytes, more than " +
           std::to_string(FilesArea::kMaxPath));
  const std::string path = r.getPath();
  FilesArea &files = ctx_.files();
  switch (r.which()) {
  case wire::FileRequest::LIST:
    reply.add(result::Files{}).entries = files.list(principal_, path);
    return;
  case wire::FileRequest::READ: {
    kj::Array<kj::byte> &bytes = reply.add(result::Data{}).bytes;
    auto [fd, size] = files.open(principal_, path);
    const uint64_t offset = std::min(r.getRead().getOffset(), size);
    const uint64_t room = ctx_.limits().maxReplyDataBytes - reply.downloadBytes;
    const uint64_t length = std::min({r.getRead().getLength(), size - offset, room});
    bytes = kj::heapArray<kj::byte>(length);
    readAt(fd.get(), offset, bytes.begin(), length, path);
    reply.downloadBytes += length;
    return;
  }
  case wire::FileRequest::WRITE: return writeFile(path, r.getWrite());
  case wire::FileRequest::REMOVE: return files.remove(principal_, path);
  case wire::FileRequest::TENSOR: return fileTensor(path, r.getTensor());
  case wire::FileRequest::GATHER: return gatherFile(path, r.getGather());
  case wire::FileRequest::SAVE_ARCHIVE: return saveArchive(path, r.getSaveArchive());
  case wire::FileRequest::LOAD_ARCHIVE: return loadArchive(path, r.getLoadArchive(), reply);
  default: throw ProtocolError{"unknown file request"};
  }
}

void Session::writeFile(const std::string &path, wire::FileWrite::Reader r) {
  // A file written in one request has a partial file of its own: another writer of the same
  // path meanwhile never mixes its bytes in.
  auto writer = ctx_.files().write(principal_, path, r.getOffset(),
                                   r.getOffset() == 0 && r.getCommit());
  for (wire::FilePart::Reader part : r.getParts()) {
    if (part.isData()) {
      writer->append(part.getData().begin(), part.getData().size());
      continue;
    }
    auto t = part.getTensor();
    at::Tensor host = hostBytes(tensorOf(t.getHandle(), "file write"), t.getMeta(), "file write");
    writer->append(host.data_ptr(), host.storage().nbytes());
  }
  if (r.getCommit())
    writer->commit(r.hasDigest() ? std::optional<ir::Hash256>(wire::decodeHash(r.getDigest()))
                                 : std::nullopt);
}

void Session::fileTensor(const std::string &path, wire::FileTensor::Reader r) {
  const uint64_t handle = r.getHandle();
  try {
    ir::TensorMeta meta;
    if (!wire::decodeMeta(r.getMeta(), meta) || meta.storageBytes() < 0)
      refuse("'" + path + "': a tensor of a malformed meta");
    if (r.getDevice() >= ctx_.devices().size())
      refuse("'" + path + "': no device rgpu:" + std::to_string(r.getDevice()));
    const uint64_t bytes = uint64_t(meta.storageBytes()), offset = r.getOffset();
    if (bytes > ctx_.limits().maxTensorBytes)
      refuse("'" + path + "': a tensor of " + memory::sizeText(bytes) +
             ", more than this server's limit per tensor");
    auto [fd, size] = ctx_.files().open(principal_, path);
    if (offset > size || bytes > size - offset)
      refuse("'" + path + "' has " + std::to_string(size) +
             " bytes; the tensor asked for is bytes [" + std::to_string(offset) + ", " +
             std::to_string(offset + bytes) + ")");
    at::Tensor host = at::empty_strided(
        meta.sizes, meta.strides,
        at::TensorOptions()
            .dtype(bridge::scalarType(meta.dtype))
            .pinned_memory(device::pinned(ctx_.devices()[r.getDevice()])));
    readAt(fd.get(), offset, host.data_ptr(), bytes, path);
    bind(handle, {onDevice(host, r.getDevice()), nullptr});
  } catch (const std::exception &e) {
    const auto *fe = dynamic_cast<const FileError *>(&e);
    bind(handle, {at::Tensor(), sessionError(e.what(), fe ? fe->pythonType : "")});
    throw;
  }
}

void Session::gatherFile(const std::string &path, wire::FileGather::Reader r) {
  const uint64_t handle = r.getHandle();
  try {
    const int8_t dtype = r.getDtype();
    const uint64_t item = ir::dtype::isValid(dtype) ? ir::dtype::itemSize(dtype) : 0;
    if (!item)
      refuse("'" + path + "': rows of an unknown dtype " + std::to_string(dtype));
    if (r.getDevice() >= ctx_.devices().size())
      refuse("'" + path + "': no device rgpu:" + std::to_string(r.getDevice()));
    if (r.getRowSizes().size() > 8)
      refuse("'" + path + "': rows of more than 8 dimensions");
    std::vector<int64_t> rowSizes;
    uint64_t rowBytes = item;
    for (int64_t s : r.getRowSizes()) {
      if (s < 0 || (s && rowBytes > ctx_.limits().maxTensorBytes / uint64_t(s)))
        refuse("'" + path + "': rows of a negative or too large size");
      rowSizes.push_back(s);
      rowBytes *= uint64_t(s);
    }
    const uint64_t rows = r.getRows(), offset = r.getOffset();
    auto [fd, size] = ctx_.files().open(principal_, path);
    if (offset > size || (rowBytes && rows > (size - offset) / rowBytes))
      refuse("'" + path + "' has " + std::to_string(size) + " bytes: not " + std::to_string(rows) +
             " rows of " + std::to_string(rowBytes) + " bytes from byte " + std::to_string(offset));
    const at::Tensor &index = tensorOf(r.getIndex(), "gather from a file");
    if (!at::isIntegralType(index.scalar_type(), /*includeBool=*/false))
      refuse("'" + path + "': rows are picked by an integer tensor, not " +
                 std::string(c10::toString(index.scalar_type())),
             "TypeError");
    at::Tensor picks = index.to(at::kCPU, at::kLong).contiguous();
    std::vector<int64_t> sizes(index.sizes().begin(), index.sizes().end());
    sizes.insert(sizes.end(), rowSizes.begin(), rowSizes.end());
    if (rowBytes && uint64_t(picks.numel()) > ctx_.limits().maxTensorBytes / rowBytes)
      refuse("'" + path + "': the rows gathered would pass this server's limit per tensor");
    at::Tensor host = at::empty(
        sizes, at::TensorOptions()
                   .dtype(bridge::scalarType(dtype))
                   .pinned_memory(device::pinned(ctx_.devices()[r.getDevice()])));
    Mapping map;
    if (size) {
      map.size = size;
      map.at = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
      if (map.at == MAP_FAILED)
        refuse("'" + path + "' cannot be mapped (" + std::strerror(errno) + ")", "OSError");
    }
    const auto *base = static_cast<const char *>(map.at) + offset;
    auto *out = static_cast<char *>(host.data_ptr());
    const int64_t *at = picks.const_data_ptr<int64_t>();
    for (int64_t k = 0; k < picks.numel(); ++k) {
      int64_t i = at[k];
      if (i < -int64_t(rows) || i >= int64_t(rows))
        refuse("'" + path + "': index " + std::to_string(i) + " is out of bounds for " +
                   std::to_string(rows) + " rows",
               "IndexError");
      if (i < 0)
        i += int64_t(rows);
      std::memcpy(out + k * rowBytes, base + uint64_t(i) * rowBytes, rowBytes);
    }
    bind(handle, {onDevice(host, r.getDevice()), nullptr});
  } catch (const std::exception &e) {
    const auto *fe = dynamic_cast<const FileError *>(&e);
    bind(handle, {at::Tensor(), sessionError(e.what(), fe ? fe->pythonType : "")});
    throw;
  }
}

void Session::saveArchive(const std::string &path,
                          capnp::List<wire::ArchiveRecord>::Reader records) {
  if (records.size() > kMaxArchiveRecords)
    refuse("'" + path + "': an archive of more than " + std::to_string(kMaxArchiveRecords) +
           " records");
  auto writer = ctx_.files().write(principal_, path, 0, /*whole=*/true);
  // The zip writer calls back into C code: a failed write is kept and raised after it returns
  // (later writes are dropped, so that its own end-of-file write cannot throw again).
  std::exception_ptr failed;
  auto sink = [&](const void *buf, size_t n) -> size_t {
    if (!failed) {
      try {
        writer->append(buf, n);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    return n;
  };
  {
    caffe2::serialize::PyTorchStreamWriter zip(sink);
    for (wire::ArchiveRecord::Reader rec : records) {
      if (failed)
        break;
      const std::string name = rec.getName();
      if (name.empty() || name.size() > 1024 || name.find('\0') != std::string::npos)
        refuse("'" + path + "': a record name that is empty, longer than 1024 bytes or holds a "
               "NUL");
      if (rec.isData()) {
        zip.writeRecord(name, rec.getData().begin(), rec.getData().size());
      } else {
        auto t = rec.getTensor();
        at::Tensor host =
            hostBytes(tensorOf(t.getHandle(), "torch.save"), t.getMeta(), "torch.save");
        zip.writeRecord(name, host.data_ptr(), host.storage().nbytes());
      }
    }
    zip.writeEndOfFile();
  }
  if (failed)
    std::rethrow_exception(failed);
  writer->commit(std::nullopt);
}

void Session::loadArchive(const std::string &path, wire::LoadArchive::Reader r, Reply &reply) {
  std::vector<result::Records::Record> &out = reply.add(result::Records{}).records;
  if (r.getDevice() >= ctx_.devices().size())
    refuse("'" + path + "': no device rgpu:" + std::to_string(r.getDevice()));
  auto [fd, size] = ctx_.files().open(principal_, path);
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  std::vector<std::string> names;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<FileAdapter>(fd.get(), size));
    names = zip->getAllRecords();
  } catch (const c10::Error &e) {
    refuse("'" + path + "' is not a torch.save archive: " + e.what_without_backtrace(),
           "RuntimeError");
  }
  if (names.size() > kMaxArchiveRecords)
    refuse("'" + path + "': an archive of more than " + std::to_string(kMaxArchiveRecords) +
           " records");
  const uint64_t first = r.getFirstHandle();
  uint64_t storages = 0, small = 0;
  for (const std::string &name : names) {
    const uint64_t n = zip->getRecordSize(name);
    if (name.rfind("data/", 0) != 0) {
      small += n;
      if (small > ctx_.limits().maxReplyDataBytes)
        refuse("'" + path + "': its records besides the storages pass " +
               memory::sizeText(ctx_.limits().maxReplyDataBytes));
      std::string bytes(n, '\0');
      zip->getRecord(name, bytes.data(), n);
      out.push_back({name, std::move(bytes), std::nullopt, n});
      continue;
    }
    if (storages == kMaxStorages)
      refuse("'" + path + "': more than " + std::to_string(kMaxStorages) + " storages");
    if (n > ctx_.limits().maxTensorBytes)
      refuse("'" + path + "': a storage of " + memory::sizeText(n) +
             ", more than this server's limit per tensor");
    at::Tensor host = at::empty(
        {int64_t(n)}, at::TensorOptions().dtype(at::kByte).pinned_memory(
                          device::pinned(ctx_.devices()[r.getDevice()])));
    if (n)
      zip->getRecord(name, host.data_ptr(), n);
    const uint64_t handle = first + storages++;
    bind(handle, {onDevice(host, r.getDevice()), nullptr});
    out.push_back({name, std::string(), handle, n});
  }
}

} // namespace rgpu::server
