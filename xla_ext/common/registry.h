// Every handler file registers its FFI targets here at load time, so the module files
// (cpu_module.cc, cuda_module.cc) need no list of ops: they expose whatever registered.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace blujax {

using Target = std::pair<std::string, XLA_FFI_Handler*>;

// One list per shared library (each module is its own .so).
inline std::vector<Target>& Targets() {
  static std::vector<Target> targets;
  return targets;
}

struct RegisterTarget {
  RegisterTarget(const char* name, XLA_FFI_Handler* handler) {
    Targets().emplace_back(name, handler);
  }
};

}  // namespace blujax

// BLUJAX_REGISTER(blujax_layer_norm_fwd, LayerNormFwd): the target name, then the handler
// defined with XLA_FFI_DEFINE_HANDLER in the same file.
#define BLUJAX_REGISTER(target, handler) \
  static const ::blujax::RegisterTarget kRegister_##target(#target, handler)
