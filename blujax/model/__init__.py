"""Models as pure functions over parameter pytrees; each takes its kernels as an `ops` namespace."""
