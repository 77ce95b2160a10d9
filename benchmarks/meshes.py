"""The runs of the mesh benchmarks (benchmarks.parallel, benchmarks.memory) as their --runs
name them: a mesh's sizes, then options after colons ("fsdp4tp2", "dp8:zero", "1" the
single-device step). No JAX here: benchmarks.memory parses its runs before JAX starts, to
ask for as many emulated devices as the largest one has."""

from __future__ import annotations

import dataclasses
import re

SIZES = ("dp", "fsdp", "tp", "cp")


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    cp: int = 1
    options: frozenset = frozenset()
    single: bool = False  # train.make_train_step, no mesh

    @property
    def devices(self) -> int:
        return self.dp * self.fsdp * self.tp * self.cp

    @property
    def ranks(self) -> int:
        """Devices over which the batch splits."""
        return self.dp * self.fsdp

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's sizes by axis (blujax.sharding.mesh.AXES)."""
        return {"data": self.dp, "fsdp": self.fsdp, "tensor": self.tp, "context": self.cp}


def parse_run(text: str, options: tuple[str, ...], single: bool = True) -> Run:
    """A Run of `text`, whose options must be among `options`; "1" (where `single`) is the
    single-device step. ValueError naming what is wrong."""
    name, *opts = text.strip().split(":")
    bad = set(opts) - set(options)
    if bad:
        raise ValueError(f"run {text!r}: unknown options {sorted(bad)}; known: {options}")
    if single and name == "1":
        return Run(text.strip(), options=frozenset(opts), single=True)
    found = re.findall(r"(dp|fsdp|tp|cp)(\d+)", name)
    if not found or "".join(f"{k}{v}" for k, v in found) != name:
        raise ValueError(f"run {text!r}: expected {'1 or ' if single else ''}sizes like dp2, "
                         f"fsdp8, fsdp4tp2")
    return Run(text.strip(), **{k: int(v) for k, v in found}, options=frozenset(opts))
