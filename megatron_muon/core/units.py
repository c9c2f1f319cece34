"""Units: the matrices Newton-Schulz works on, as slices of (TP-unsharded) 2-D parameters.

A unit is a set of row blocks (``dim=0``) or column blocks (``dim=1``) of a parameter,
concatenated in order, optionally restricted to one range of the other dimension
(``cross``: a *part* of a unit whose Newton-Schulz is split across ranks, ``split_unit``).  Megatron's fused ``linear_qkv`` interleaves its rows per query
group as [q_group, k, v] x num_query_groups; its Q, K and V units each gather one block
per group.  MoE experts stored side by side are one unit each; a SwiGLU ``linear_fc1``
([gate; up] stacked on rows) may be split into two units.

Pure index maths: nothing here knows about Megatron or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "Unit",
    "whole_units",
    "qkv_units",
    "head_units",
    "gate_up_units",
    "expert_units",
    "extract_unit",
    "insert_unit",
    "unit_flat_indices",
    "shard_units",
    "long_axis",
    "split_unit",
]


@dataclass(frozen=True)
class Unit:
    """One NS matrix inside a parameter of shape ``param_shape``."""

    param_shape: tuple[int, int]
    dim: int  # 0: blocks of rows, 1: blocks of columns
    blocks: tuple[tuple[int, int], ...]  # (start, length) along ``dim``
    name: str = ""
    cross: Optional[tuple[int, int]] = None  # (start, length) along the other dim; None: all

    @property
    def shape(self) -> tuple[int, int]:
        length = sum(l for _, l in self.blocks)
        m, n = self.param_shape
        if self.cross is not None:
            m, n = (m, self.cross[1]) if self.dim == 0 else (self.cross[1], n)
        return (length, n) if self.dim == 0 else (m, length)

    def cross_range(self) -> tuple[int, int]:
        """``(start, length)`` of the unit along the other dimension than ``dim``."""
        return self.cross if self.cross is not None else (0, self.param_shape[1 - self.dim])

    @property
    def numel(self) -> int:
        m, n = self.shape
        return m * n


def _check_2d(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"Muon works on 2-D matrices; got a parameter of shape {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def whole_units(shape: Sequence[int]) -> list[Unit]:
    m, n = _check_2d(shape)
    return [Unit((m, n), 0, ((0, m),), "")]


def qkv_units(shape: Sequence[int], num_query_groups: int, heads_per_group: int,
              head_dim: int, *, gate: bool = False, per_head: bool = False) -> list[Unit]:
    """Q, K, V units of Megatron's fused ``linear_qkv`` weight, whose rows are interleaved
    per query group as [q, k, v] (``gate``: gated attention's [q, gate, k, v], the gate one
    row block per query head like q).  ``per_head``: one unit per attention head of q (and
    of the gate) and per query group of k and v, instead of one unit each for all of Q, K
    and V."""
    m, n = _check_2d(shape)
    q = heads_per_group * head_dim
    k_at = q * (2 if gate else 1)  # k follows q (and the gate) in each group's rows
    per_group = k_at + 2 * head_dim
    if per_group * num_query_groups != m:
        what = "2 x " if gate else ""
        raise ValueError(
            f"linear_qkv weight has {m} rows, but {num_query_groups} query groups x "
            f"({what}{heads_per_group} heads x {head_dim} + 2 x {head_dim}) = "
            f"{per_group * num_query_groups}"
        )
    starts = [g * per_group for g in range(num_query_groups)]
    blocks = [("q", 0, q)] + [("gate", q, q)] * gate + [("k", k_at, head_dim),
                                                        ("v", k_at + head_dim, head_dim)]
    if not per_head:
        return [Unit((m, n), 0, tuple((s + at, size) for s in starts), tag)
                for tag, at, size in blocks]
    units = []
    for tag, at, size in blocks:  # q0 q1 ... (per head), k0 k1 ... (per query group)
        heads = heads_per_group if tag in ("q", "gate") else 1
        units += [Unit((m, n), 0, ((s + at + h * head_dim, head_dim),), f"{tag}{g * heads + h}")
                  for g, s in enumerate(starts) for h in range(heads)]
    return units


def head_units(shape: Sequence[int], num_heads: int, parts: Sequence[tuple[str, int]]) -> list[Unit]:
    """One unit per attention head and part of a weight whose rows are per head
    [part_0, part_1, ...] (``parts``: (tag, rows) each): MLA's ``linear_q_up_proj`` (one
    part: the head's q) and ``linear_kv_up_proj`` (k without RoPE, then v)."""
    m, n = _check_2d(shape)
    per_head = sum(rows for _, rows in parts)
    if per_head * num_heads != m:
        raise ValueError(f"weight has {m} rows, but {num_heads} heads x {per_head} = "
                         f"{per_head * num_heads}")
    units, at = [], 0
    for tag, rows in parts:
        units += [Unit((m, n), 0, ((h * per_head + at, rows),), f"{tag}{h}")
                  for h in range(num_heads)]
        at += rows
    return units


def gate_up_units(shape: Sequence[int]) -> list[Unit]:
    """Gate and up halves of a SwiGLU ``linear_fc1`` weight ([gate; up] on rows)."""
    m, n = _check_2d(shape)
    if m % 2:
        raise ValueError(f"gate/up split needs an even number of rows, got {m}")
    h = m // 2
    return [Unit((m, n), 0, ((0, h),), "gate"), Unit((m, n), 0, ((h, h),), "up")]


def expert_units(shape: Sequence[int], num_experts: int, dim: int) -> list[Unit]:
    """One unit per expert for experts stored side by side along ``dim``."""
    m, n = _check_2d(shape)
    size = (m, n)[dim]
    if size % num_experts:
        raise ValueError(f"dimension {dim} of size {size} does not split into {num_experts} experts")
    e = size // num_experts
    return [Unit((m, n), dim, ((i * e, e),), f"expert{i}") for i in range(num_experts)]


def _positions(unit: Unit) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + l) for s, l in unit.blocks])


def unit_flat_indices(unit: Unit) -> torch.Tensor:
    """Flat (row-major) indices into the parameter of every unit element, in unit order."""
    m, n = unit.param_shape
    pos = _positions(unit)
    c0, cl = unit.cross_range()
    other = torch.arange(c0, c0 + cl)
    if unit.dim == 0:
        return (pos[:, None] * n + other[None, :]).reshape(-1)
    return (other[:, None] * n + pos[None, :]).reshape(-1)


def _cross(t: torch.Tensor, unit: Unit) -> torch.Tensor:
    return t if unit.cross is None else t.narrow(1 - unit.dim, *unit.cross)


def extract_unit(param: torch.Tensor, unit: Unit) -> torch.Tensor:
    if len(unit.blocks) == 1:
        s, l = unit.blocks[0]
        return _cross(param.narrow(unit.dim, s, l), unit)
    return torch.cat([_cross(param.narrow(unit.dim, s, l), unit) for s, l in unit.blocks],
                     dim=unit.dim)


def insert_unit(param: torch.Tensor, unit: Unit, value: torch.Tensor) -> None:
    offset = 0
    for s, l in unit.blocks:
        _cross(param.narrow(unit.dim, s, l), unit).copy_(value.narrow(unit.dim, offset, l))
        offset += l


def long_axis(shape: Sequence[int]) -> int:
    """The axis of a unit of ``shape`` that Newton-Schulz does not contract: rows for a tall
    matrix (NS works on its transpose), else columns (``newton_schulz``'s orientation)."""
    return 0 if shape[0] > shape[1] else 1


def split_unit(unit: Unit, widths: Sequence[int]) -> list[Unit]:
    """``unit`` cut along its long side (``long_axis``) into consecutive parts of ``widths``
    (summing to the long side): each part keeps the whole short side, so that
    ``X X^T`` of the unit is the sum of its parts' (the split Newton-Schulz)."""
    axis = long_axis(unit.shape)
    if sum(widths) != unit.shape[axis] or any(w <= 0 for w in widths):
        raise ValueError(f"part widths {list(widths)} do not tile the long side "
                         f"{unit.shape[axis]} of a unit of shape {unit.shape}")
    parts, lo = [], 0
    for j, w in enumerate(widths):
        name = f"{unit.name}/{j}"
        if axis == unit.dim:  # a sub-range of the concatenated blocks
            blocks, pos = [], 0
            for s, l in unit.blocks:
                a, b = max(lo, pos), min(lo + w, pos + l)
                if a < b:
                    blocks.append((s + a - pos, b - a))
                pos += l
            parts.append(Unit(unit.param_shape, unit.dim, tuple(blocks), name, unit.cross))
        else:  # a range of the other dimension
            c0, _ = unit.cross_range()
            parts.append(Unit(unit.param_shape, unit.dim, unit.blocks, name, (c0 + lo, w)))
        lo += w
    return parts


def shard_units(units: Sequence[Unit], dim: int, shard_blocks: Sequence[Sequence[tuple[int, int]]]
                ) -> list[Unit]:
    """Split units along TP shards: the per-shard ("blockwise") units of one parameter.

    ``shard_blocks[t]`` are the (start, length) blocks along ``dim`` that TP shard t holds,
    in the parameter's own coordinates.  Row units are intersected with row shards; with
    column shards (row-parallel layers) every unit must span all rows.
    """
    out = []
    for u in units:
        for t, blocks in enumerate(shard_blocks):
            if dim == 0 and u.dim == 0:
                inter = []
                for s, l in u.blocks:
                    for bs, bl in blocks:
                        lo, hi = max(s, bs), min(s + l, bs + bl)
                        if lo < hi:
                            inter.append((lo, hi - lo))
                if inter:
                    out.append(Unit(u.param_shape, 0, tuple(sorted(inter)), f"{u.name}@tp{t}"))
            elif dim == 1 and u.dim == 0 and u.blocks == ((0, u.param_shape[0]),):
                out.append(Unit(u.param_shape, 1, tuple(blocks), f"{u.name}@tp{t}"))
            else:
                raise ValueError(f"cannot split unit {u} along TP dim {dim}")
    return out
