"""blujax: GPT-style training in functional JAX on hand-written XLA FFI kernels."""

from blujax._ffi import kernel_backends
from blujax import kernels
from blujax import optim

__all__ = ["kernel_backends", "kernels", "optim"]
__version__ = "0.1.0"
