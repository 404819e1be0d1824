"""The interconnect traffic of a compiled program: bytes each device sends in its collectives.

XLA's cost analysis counts a collective's HBM bytes but not what crosses the chips' links. This
reads the compiled program's text: every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute (and their async `-start` halves), with the size of its replica groups, and
charges each device what a bandwidth-optimal ring sends over a group of n:

    all-reduce          2 (n - 1) / n x the reduced bytes
    all-gather          (n - 1) / n   x the gathered result
    reduce-scatter      (n - 1)       x the scattered result (each device's piece)
    all-to-all          (n - 1) / n   x the exchanged bytes
    collective-permute  1             x the sent bytes

An all-reduce inside an `all-reduce-scatter` fusion (the TPU compiler's reduce-scatter written as
an all-reduce and a slice of it) is charged as the reduce-scatter it runs as: (n - 1) / n.

As XLA's counts, a loop's body is counted once (the roofline differences compiles for loops).
"""

from __future__ import annotations

import re

_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = <shape or tuple of shapes> <op>(` with op one of _OPS, optionally `-start`.
_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(_OPS) + r")(-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(_ITEM) + r")\[([\d,]*)\]")
# Replica groups as the compiler prints them: {{0,1,..},..}, iota [groups,size]<=[..], a named
# mesh mesh['a'=4,'b'=2] {'a'}, or {} (one group of every device).
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,]*\}|\[(\d+),(\d+)\]<=|mesh\[([^\]]*)\]\s*\{([^}]*)\}|\{\})")
_AXIS = re.compile(r"'([^']+)'=(\d+)")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")  # a computation's header, at column 0


def _sizes(shapes: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(shapes):
        n = _ITEM[dtype]
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n)
    return out


def group_size(line: str, devices: int = 0) -> int:
    """Devices per replica group of one collective's line; `devices` for a group of all of them."""
    m = _GROUPS.search(line)
    if m is None:
        return 0
    if m.group(2):  # [groups,size]<=[...]
        return int(m.group(3))
    if m.group(4) is not None:  # mesh['a'=4,...] {'a',...}
        sizes = dict((a, int(n)) for a, n in _AXIS.findall(m.group(4)))
        n = 1
        for a in re.findall(r"'([^']+)'", m.group(5)):
            n *= sizes[a]
        return n
    if m.group(1) == "{}":
        return devices
    return len(m.group(1)[2:-1].split(","))


def ici_bytes(hlo: str) -> float:
    """Bytes each device sends over the interconnect in the collectives of `hlo` (compiled text)."""
    total = 0.0
    partitions = _PARTITIONS.search(hlo)
    devices = int(partitions.group(1)) if partitions else 0
    scatter = False  # inside an all-reduce-scatter fusion's computation
    for line in hlo.splitlines():
        if line[:1] not in ("", " ", "}"):
            header = _COMPUTATION.match(line)
            scatter = bool(header) and header.group(1).startswith("all-reduce-scatter")
        if not any(op in line for op in _OPS):  # most lines: skip the regex
            continue
        m = _LINE.search(line)
        if m is None:
            continue
        shapes, op, start = m.group(1), m.group(2), m.group(3)
        sizes = _sizes(shapes)
        if start and op == "all-gather":  # (operands..., results...)
            sizes = sizes[len(sizes) // 2:]
        elif start and op == "collective-permute":  # (operand, result, contexts...)
            sizes = sizes[:1]
        size = float(sum(sizes))
        if op == "collective-permute":
            total += size
            continue
        n = group_size(line, devices)
        if n < 2:
            continue
        if scatter and op == "all-reduce":
            op = "all-gather"  # a reduce-scatter of `size`: each device sends (n - 1) / n of it, as a gather
        total += {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
                  "all-to-all": (n - 1) / n}[op] * size
    return total
