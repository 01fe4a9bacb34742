//===- rgpu/client/Versions.h - Which tensor an in-place op made a new version of -===//
//
// Functionalization turns `p.add_(g)` into `p` holding the result of `add(p, g)`: a new
// LazyTensorImpl. A run the user cancels (Ctrl-C, rgpu.cancel()) binds none of its outputs,
// so that a step is never half applied; but a parameter must then read as it was before the
// step, not as an error. So every op that writes its arguments is watched at the
// Functionalize key: the tensor a written argument holds afterwards is noted as a new version
// of the device data it held before (LazyTensorImpl::versionOf), and the cut that computes it
// asks the server to bind it back to that data if the run is cancelled (wire::Run.restores).
//
//===----------------------------------------------------------------------===//
#pragma once

namespace rgpu::client {

/// Registers the watch for every aten op that writes an argument (in-place, out=, mutable
/// arguments), around the Functionalize kernel it has. Called once, after every kernel of that
/// key is registered (checkOutOps first).
void trackVersions();

} // namespace rgpu::client
