// blujax._cpu: every CPU handler in xla_ext/cpu/, by FFI target name.
#include "common/module.h"

NB_MODULE(_cpu, m) {
  m.doc() = "blujax CPU kernels as XLA FFI handlers";
  m.def("registrations", &blujax::Registrations,
        "FFI target name -> handler capsule, registered for platform 'cpu'.");
}
