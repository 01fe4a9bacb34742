//===- server/Device.h - The device's name, properties and memory figures -===//
//
// What torch.rgpu's memory functions and get_device_name/get_device_properties read, answered
// for the server's device. On CUDA the figures are the caching allocator's and the driver's,
// for the whole server process (as torch.cuda's are for the whole process). A CPU server
// answers with the bytes the asking session holds and its peak (server/Memory.h), as a local
// process sees its own, the machine's physical memory under --memory-limit, and its processor.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "Memory.h"

#include "rgpu/wire/Wire.h"

#include <c10/core/Device.h>
#include <llvm/Support/Error.h>

#include <string>
#include <vector>

namespace at {
class Tensor;
}

namespace rgpu::server::device {

/// Resets the peaks and empties the allocator's cache of \p dev, as far as \p request asks:
/// the peak of the session's \p account, and a CUDA device's peaks when \p deviceWide (every
/// session open is of the asking principal: another's figures are never reset).
void apply(c10::Device dev, wire::MemoryRequest::Reader request, memory::Account &account,
           bool deviceWide);
/// Fills \p out with the figures of \p dev, as the session of \p account sees them.
void figures(c10::Device dev, wire::DeviceMemory::Builder out, const memory::Account &account);

/// The devices \p list names (--devices "cuda:0,cuda:1", "cpu"; empty: cuda if this machine
/// has it, else cpu), checked against this machine: at most wire::kMaxDevices, all CPU or all
/// CUDA.
llvm::Expected<std::vector<c10::Device>> parseList(const std::string &list);

/// Host memory for a transfer to or from \p dev: pinned for a CUDA device (the copy engine
/// reads it directly, without a bounce through pageable memory).
bool pinned(c10::Device dev);

/// \p host (pinned) copied to \p dev on the server's copy stream, which runs beside the
/// kernels already queued; the kernels that use the result wait for the copy, and nothing else
/// does.
at::Tensor toDevice(const at::Tensor &host, c10::Device dev);

/// \p t copied into \p host (pinned, laid out as the client asked) on the copy stream, after
/// the kernels that computed \p t, but not the ones queued after them; returns when the bytes
/// are there.
void toHost(const at::Tensor &t, const at::Tensor &host);

/// What a failed op's error means for the device. CUDA's out-of-memory error empties the
/// caching allocator (memory the failed run's freed tensors left cached goes back to the
/// device, for this session and the others). An error that leaves the CUDA context unusable
/// (a device-side assert, an illegal address) returns true: the server must exit.
bool afterError(c10::Device dev, const std::string &message);

/// The exit status of a server whose CUDA context is lost: a supervisor restarts it.
constexpr int kExitDeviceLost = 75;

} // namespace rgpu::server::device
