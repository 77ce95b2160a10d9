// Helpers shared by the CPU handlers: dtype dispatch and typed views of FFI buffers.
#pragma once

#include <cstdint>

#include "common/ffi_util.h"

namespace blujax {

// Calls fn with a value of the storage type of a float buffer (uint16_t stands for bfloat16).
template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: fn(float{}); return ffi::Error::Success();
    case ffi::DataType::F64: fn(double{}); return ffi::Error::Success();
    case ffi::DataType::BF16: fn(uint16_t{}); return ffi::Error::Success();
    default: return InvalidArgument("unsupported dtype ", DtypeName(t));
  }
}

template <typename T> const T* In(const ffi::AnyBuffer& b) {
  return reinterpret_cast<const T*>(b.untyped_data());
}
template <typename T> T* Out(ffi::Result<ffi::AnyBuffer>& b) {
  return reinterpret_cast<T*>(b->untyped_data());
}

}  // namespace blujax
