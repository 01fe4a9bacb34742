#pragma once
/// Failures as values that cannot be ignored.
///
/// A function that can fail returns `llvm::Error` (nothing else to say on success) or
/// `llvm::Expected<T>` (a value or a failure); both are `[[nodiscard]]`, so a caller cannot drop
/// a failure without a word, and a value cannot be mistaken for an error message. Failures carry
/// one human message (what was wrong and, where it helps, what to do); these helpers make and
/// read them.

#include <llvm/ADT/Twine.h>
#include <llvm/Support/Error.h>

#include <string>

namespace rgpu {

/// A failure whose message is `message`.
inline llvm::Error failure(const llvm::Twine &message) {
  return llvm::make_error<llvm::StringError>(message, llvm::inconvertibleErrorCode());
}

/// The message of `error` (empty for success); consumes it.
inline std::string message(llvm::Error error) {
  if (!error) {
    return {};
  }
  return llvm::toString(std::move(error));
}

} // namespace rgpu
