# The build's third-party libraries from one folder made by tools/device/make-deps.sh
# (-DRGPU_DEPS_DIR=...), for a machine that has none of our Debian packages: the same targets and
# variables that find_package(LLVM), find_package(CapnProto) and pkg-config give otherwise, and
# the Cap'n Proto sources generated ahead (that machine has no capnp compiler).
foreach(f include/capnp/common.h include/uv.h include/sodium.h include/zlib.h include/llvm/ADT/SmallVector.h
          gen/rgpu.capnp.h lib/libLLVMSupport.a)
  if(NOT EXISTS "${RGPU_DEPS_DIR}/${f}")
    message(FATAL_ERROR "RGPU_DEPS_DIR=${RGPU_DEPS_DIR} lacks ${f}: make it with tools/device/make-deps.sh")
  endif()
endforeach()

function(rgpu_carried_lib target kind file)
  add_library(${target} ${kind} IMPORTED GLOBAL)
  set_target_properties(${target} PROPERTIES IMPORTED_LOCATION "${RGPU_DEPS_DIR}/lib/${file}"
                        INTERFACE_INCLUDE_DIRECTORIES "${RGPU_DEPS_DIR}/include"
                        INTERFACE_LINK_LIBRARIES "${ARGN}")
endfunction()

# LLVM Support is static, as always; the others are shared (Debian's static ones are not
# position-independent, and rgpu's Python modules are shared objects), and the build's RPATH
# finds them in the folder.
file(GLOB _kj RELATIVE "${RGPU_DEPS_DIR}/lib" "${RGPU_DEPS_DIR}/lib/libkj-*.so")
file(GLOB _capnp RELATIVE "${RGPU_DEPS_DIR}/lib" "${RGPU_DEPS_DIR}/lib/libcapnp-*.so")
rgpu_carried_lib(rgpu_dep_kj SHARED ${_kj} Threads::Threads)
rgpu_carried_lib(CapnProto::capnp SHARED ${_capnp} rgpu_dep_kj)
rgpu_carried_lib(PkgConfig::UV SHARED libuv.so.1)
rgpu_carried_lib(PkgConfig::SODIUM SHARED libsodium.so.23)
rgpu_carried_lib(ZLIB::ZLIB SHARED libz.so.1)
rgpu_carried_lib(rgpu_dep_tinfo SHARED libtinfo.so.6)
rgpu_carried_lib(rgpu_dep_llvm_demangle STATIC libLLVMDemangle.a)
rgpu_carried_lib(rgpu_dep_llvm_support STATIC libLLVMSupport.a
                 "rgpu_dep_llvm_demangle;rgpu_dep_tinfo;ZLIB::ZLIB;Threads::Threads;rt;dl;m")

set(LLVM_INCLUDE_DIRS "${RGPU_DEPS_DIR}/include")
set(LLVM_DEFINITIONS -D_GNU_SOURCE -D__STDC_CONSTANT_MACROS -D__STDC_FORMAT_MACROS -D__STDC_LIMIT_MACROS)
set(RGPU_LLVM_LIBS rgpu_dep_llvm_support)
set(RGPU_CAPNP_GENERATED "${RGPU_DEPS_DIR}/gen")
