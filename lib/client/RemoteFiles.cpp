//===- lib/client/RemoteFiles.cpp - The server's files area, from the client -===//
//
// rgpu.remote's requests: each is one command (wire::FileRequest). Tensors go as the handles
// the server holds them under, never as bytes: a file written from rgpu tensors, and tensors
// read from a file, stay on the server's side of the link.
//
//===----------------------------------------------------------------------===//
#include "SessionState.h"
#include "Tracing.h"

#include "rgpu/client/Errors.h"

namespace rgpu::client {

namespace {
/// The most storages one archive may have: a LoadArchive reserves as many handles.
constexpr uint64_t kArchiveHandles = 1 << 16;
} // namespace

command::StoredTensor Session::State::stored(const at::Tensor &t) {
  LazyTensorImpl *impl = lazyImpl(t);
  TORCH_CHECK(impl, "rgpu: a file's part must be an rgpu tensor or bytes, not a tensor on ",
              t.device());
  if (impl->value.pending())
    cut("file write");
  checkCurrent(impl->value);
  return {impl->value.data->handle, impl->downloadLayout()};
}

Reply Session::State::fileRequest(command::File c) {
  queue(std::move(c)); // raises SessionLost if the session is lost
  return flush(true);
}

std::variant<std::string, command::StoredTensor> Session::State::partOf(const FilePart &p) {
  if (p.tensor.defined())
    return stored(p.tensor);
  return p.data;
}

namespace {
at::Tensor lazyOf(uint64_t handle, const ir::TensorMeta &meta, int device) {
  llvm::IntrusiveRefCntPtr<DeviceData> data(new DeviceData(handle, meta));
  return forUser(makeLazy(Value{nullptr, 0, std::move(data)}, meta, c10::DeviceIndex(device)));
}
} // namespace

std::vector<FileEntry> Session::listFiles(const std::string &path) {
  Lock lock(*this);
  Reply r = s_->fileRequest({path, command::file::List{}});
  if (r.files.size() != 1)
    s_->lose("the server did not answer a listing");
  return std::move(r.files[0]);
}

std::string Session::readFile(const std::string &path, uint64_t offset, uint64_t length) {
  Lock lock(*this);
  Reply r = s_->fileRequest({path, command::file::Read{offset, length}});
  if (r.data.size() != 1)
    s_->lose("the server did not answer a file read");
  return std::move(r.data[0]);
}

void Session::writeFile(const std::string &path, uint64_t offset,
                        const std::vector<FilePart> &parts, bool commit,
                        const std::string &digest) {
  Lock lock(*this);
  command::file::Write w;
  w.offset = offset;
  w.commit = commit;
  if (!digest.empty()) {
    ir::Hash256 h;
    TORCH_CHECK(ir::Hash256::parse(digest, h), "rgpu: a digest is 64 hex digits, not '", digest,
                "'");
    w.digest = h;
  }
  for (const FilePart &p : parts)
    w.parts.push_back(s_->partOf(p));
  s_->fileRequest({path, std::move(w)});
}

void Session::removeFile(const std::string &path) {
  Lock lock(*this);
  s_->fileRequest({path, command::file::Remove{}});
}

void Session::saveArchive(const std::string &path, const std::vector<FilePart> &records) {
  Lock lock(*this);
  command::file::SaveArchive a;
  for (const FilePart &p : records)
    a.records.push_back({p.name, s_->partOf(p)});
  s_->fileRequest({path, std::move(a)});
}

std::vector<Session::FilePart> Session::loadArchive(const std::string &path, int device) {
  Lock lock(*this);
  const uint64_t first = s_->newHandles(kArchiveHandles);
  Reply r = s_->fileRequest({path, command::file::LoadArchive{first, uint8_t(device)}});
  if (r.records.size() != 1)
    s_->lose("the server did not answer an archive's read");
  std::vector<FilePart> out;
  for (ArchiveRecord &rec : r.records[0]) {
    FilePart p;
    p.name = std::move(rec.name);
    if (rec.handle) {
      if (rec.handle < first || rec.handle >= first + kArchiveHandles)
        s_->lose("the server bound an archive's storage to a handle it was not given");
      p.tensor = lazyOf(rec.handle,
                        ir::TensorMeta::contiguous(ir::dtype::Byte, {int64_t(rec.size)}), device);
    } else {
      p.data = std::move(rec.data);
    }
    out.push_back(std::move(p));
  }
  return out;
}

at::Tensor Session::fileTensor(const std::string &path, uint64_t offset, at::ScalarType dtype,
                               at::IntArrayRef sizes, at::IntArrayRef strides, int device) {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, s_->transport.lostReason());
  ir::TensorMeta meta;
  meta.dtype = int8_t(dtype);
  meta.sizes.assign(sizes.begin(), sizes.end());
  meta.strides.assign(strides.begin(), strides.end());
  TORCH_CHECK(meta.sizes.size() == meta.strides.size() && meta.storageBytes() >= 0,
              "rgpu: a file's tensor needs as many strides as sizes, none negative");
  const uint64_t handle = s_->newHandles(1);
  s_->queue(command::File{path, command::file::Tensor{handle, offset, meta, uint8_t(device)}});
  return lazyOf(handle, meta, device);
}

at::Tensor Session::gatherFile(const std::string &path, uint64_t offset, at::ScalarType dtype,
                               uint64_t rows, at::IntArrayRef rowSizes, const at::Tensor &index,
                               int device) {
  Lock lock(*this);
  if (lost())
    raise(ErrorKind::SessionLost, s_->transport.lostReason());
  command::file::Gather g;
  g.index = s_->stored(index).handle;
  g.handle = s_->newHandles(1);
  g.offset = offset;
  g.rows = rows;
  g.dtype = int8_t(dtype);
  g.rowSizes.assign(rowSizes.begin(), rowSizes.end());
  g.device = uint8_t(device);
  std::vector<int64_t> sizes(index.sizes().begin(), index.sizes().end());
  sizes.insert(sizes.end(), rowSizes.begin(), rowSizes.end());
  ir::TensorMeta meta = ir::TensorMeta::contiguous(int8_t(dtype), sizes);
  const uint64_t handle = g.handle;
  s_->queue(command::File{path, std::move(g)});
  return lazyOf(handle, meta, device);
}

} // namespace rgpu::client
