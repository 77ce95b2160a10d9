// What both nanobind modules export: the registered handlers as {target name: capsule}.
#pragma once

#include <nanobind/nanobind.h>

#include "common/registry.h"

namespace blujax {

inline nanobind::dict Registrations() {
  nanobind::dict targets;
  for (const auto& [name, handler] : Targets())
    targets[name.c_str()] = nanobind::capsule(reinterpret_cast<void*>(handler));
  return targets;
}

}  // namespace blujax
