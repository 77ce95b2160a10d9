"""One module per op, each with `cases(quick: bool) -> list[harness.Case]`; kernels.py runs them."""
