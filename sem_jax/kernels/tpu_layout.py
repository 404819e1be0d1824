"""How a TPU stores an array by default, for kernels that read weights where they lie.

A Pallas kernel's operand must be in the layout the kernel indexes; in any other XLA copies it
first (a copy of a layer's weights at every decode step). A TPU's default layout tiles the last
two dims by (8, 128) and moves a dim out of the tiles where it would fill them poorly; these
rules say where, and `tests/test_scale.py` checks them against the compiler's default layouts.
"""

from __future__ import annotations


def lanes_swapped(shape: tuple[int, ...]) -> bool:
    """Whether the last two dims of `shape` are stored swapped: the last does not fill whole
    128-lane tiles and the one before does (a 7B device's [3584, 1184] slice of the gate kernel
    is stored as [1184, 3584])."""
    return shape[-1] % 128 != 0 and shape[-2] % 128 == 0


def sublanes_moved(shape: tuple[int, ...]) -> bool:
    """Whether an array [..., E, H, 128] (lanes whole) is stored as [..., H, E, 128], E in its
    tiles: where H is not whole 8-row tiles and not 2 or 4 rows, which get tiles of their own
    size (a 7B device's 7 query heads; its one KV head, whose tiles are E's either way)."""
    h = shape[-2]
    return h % 8 != 0 and h not in (2, 4)
