"""blujax: GPT-style training in functional JAX on hand-written XLA FFI kernels."""

from blujax._ffi import kernel_backends
from blujax import kernels

__all__ = ["kernel_backends", "kernels"]
__version__ = "0.1.0"
