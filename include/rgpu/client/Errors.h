//===- rgpu/client/Errors.h - How the client's errors reach the user -------===//
//
// Every error the client raises goes through raise(), so that the Python glue can turn each
// kind into its own exception class instead of a RuntimeError.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <string>

namespace rgpu::client {

/// How errors reach the user; the Python glue replaces the default (std::runtime_error) so that
/// they surface as rgpu.RemoteError and rgpu.SessionLost.
/// A remote error may name the Python exception CPU eager raises for it (wire::Error.pythonType:
/// "IndexError", ...); it is raised as an rgpu.RemoteError that is also one of those.
/// Interrupted: a wait was interrupted (SIGINT, rgpu.cancel()) and the server stopped this
/// session's runs; raised as what Python's SIGINT handler raises, else rgpu.Cancelled.
enum class ErrorKind { Remote, SessionLost, Auth, Interrupted };
/// wire::Error.pythonType of a value whose run a Cancel stopped.
inline constexpr const char *kCancelledType = "Cancelled";
using ErrorRaiser = void (*)(ErrorKind, const std::string &message, const std::string &pythonType);
void setErrorRaiser(ErrorRaiser raiser);
[[noreturn]] void raise(ErrorKind kind, const std::string &message,
                        const std::string &pythonType = {});

} // namespace rgpu::client
