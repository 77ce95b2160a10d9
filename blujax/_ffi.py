"""Loads blujax's compiled kernel libraries once, when blujax is imported, and registers their
XLA FFI targets.

`blujax._cpu` is always built; `blujax._cuda` where the build found nvcc and a GPU, or was asked
for it (BLUJAX_CUDA=ON). Each library exports {target name: handler capsule}; the same target
names are registered for platform "cpu" and "CUDA", so one traced program lowers to our kernels
on either.
"""

from __future__ import annotations

import functools
import importlib

import jax

# library name -> (module, XLA platform name)
_LIBRARIES = {"cpu": ("blujax._cpu", "cpu"), "cuda": ("blujax._cuda", "CUDA")}

_REBUILD_HINT = (
    "Rebuild blujax with the CUDA kernels on a machine with nvcc on PATH and jax's CUDA "
    "plugin installed:\n"
    "    BLUJAX_CUDA=ON pip install --no-build-isolation --force-reinstall --no-deps .\n"
    "or run on the CPU with JAX_PLATFORMS=cpu."
)


@functools.cache
def _load() -> tuple[dict[str, object], dict[str, str]]:
    loaded, missing = {}, {}
    for name, (module_name, platform) in _LIBRARIES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            missing[name] = str(e)
            continue
        for target, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform)
        loaded[name] = module
    return loaded, missing


def kernel_backends() -> tuple[str, ...]:
    """Which kernel libraries loaded: ("cpu",) or ("cpu", "cuda")."""
    return tuple(_load()[0])


def current_platform() -> str:
    """The platform ops are traced for: the default device's if one is set, else JAX's backend."""
    device = jax.config.jax_default_device
    if device is not None and not isinstance(device, str):
        return device.platform
    return jax.default_backend()


def require_kernels(op: str) -> None:
    """Called by every op at trace time: the kernels for the backend JAX runs on must exist.

    There is no silent fallback to other code: without our CUDA library on a GPU this raises.
    """
    loaded, missing = _load()
    if "cpu" not in loaded:
        raise ImportError(
            f"blujax.{op}: the compiled kernel library blujax._cpu did not load "
            f"({missing.get('cpu')}). Reinstall blujax: pip install ."
        )
    if current_platform() == "gpu" and "cuda" not in loaded:
        raise RuntimeError(
            f"blujax.{op}: JAX runs on a GPU but blujax was built without its CUDA kernels "
            f"(blujax._cuda: {missing.get('cuda')}).\n{_REBUILD_HINT}"
        )


# At import, not when the first op traces: a program that names a target itself
# (jax.ffi.ffi_call("blujax_adamw", ...)) finds it whatever ran before it. Registering starts no
# backend (XLA keeps it until the platform's client is made), so jax may still be configured
# after `import blujax`.
_load()
