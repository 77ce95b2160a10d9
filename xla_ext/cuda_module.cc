// blujax._cuda: every CUDA handler in xla_ext/cuda/, by FFI target name.
#include "common/module.h"

NB_MODULE(_cuda, m) {
  m.doc() = "blujax CUDA kernels as XLA FFI handlers";
  m.def("registrations", &blujax::Registrations,
        "FFI target name -> handler capsule, registered for platform 'CUDA'.");
}
