# libtorch from the folders of Python's torch package (-DRGPU_TORCH_FROM_PYTHON=ON), for a
# machine whose torch is a CUDA build but whose CUDA toolkit does not satisfy TorchConfig.cmake:
# rgpu compiles no CUDA code, so it needs only torch's headers and shared libraries. Sets what
# find_package(Torch) sets and this build uses: TORCH_LIBRARIES and TORCH_INSTALL_PREFIX, and
# RGPU_TORCH_VERSION. -DRGPU_TORCH_PACKAGE_DIR names torch's folder instead of asking Python.
if(RGPU_TORCH_PACKAGE_DIR)
  # pip's build (setup.py) names torch's folder: its isolated build environment cannot import
  # torch. Every torch wheel since 2.7 uses the C++11 ABI, the compiler's default.
  set(TORCH_INSTALL_PREFIX "${RGPU_TORCH_PACKAGE_DIR}")
  file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _version REGEX "^__version__")
  string(REGEX REPLACE "^__version__ = '([^'+]+).*" "\\1" RGPU_TORCH_VERSION "${_version}")
  set(_abi 1)
else()
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
            "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__.split('+')[0])"
    OUTPUT_VARIABLE _torch RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "RGPU_TORCH_FROM_PYTHON: ${Python3_EXECUTABLE} cannot import torch")
  endif()
  string(REPLACE "\n" ";" _torch "${_torch}")
  list(GET _torch 0 TORCH_INSTALL_PREFIX)
  list(GET _torch 1 _abi)
  list(GET _torch 2 RGPU_TORCH_VERSION)
endif()

set(_lib "${TORCH_INSTALL_PREFIX}/lib")
add_library(rgpu_torch INTERFACE)
target_include_directories(rgpu_torch SYSTEM INTERFACE "${TORCH_INSTALL_PREFIX}/include"
                           "${TORCH_INSTALL_PREFIX}/include/torch/csrc/api/include")
target_compile_definitions(rgpu_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_abi})
target_link_libraries(rgpu_torch INTERFACE "${_lib}/libtorch.so" "${_lib}/libtorch_cpu.so"
                      "${_lib}/libc10.so")
# A CUDA build: the server must load torch_cuda even though it names none of its symbols, or
# at::globalContext().hasCUDA() is false.
if(EXISTS "${_lib}/libtorch_cuda.so")
  target_link_libraries(rgpu_torch INTERFACE "-Wl,--no-as-needed,${_lib}/libtorch_cuda.so"
                        "${_lib}/libc10_cuda.so")
endif()
list(APPEND CMAKE_BUILD_RPATH "${_lib}")
set(TORCH_LIBRARIES rgpu_torch)
message(STATUS "libtorch ${RGPU_TORCH_VERSION} from ${TORCH_INSTALL_PREFIX}")
