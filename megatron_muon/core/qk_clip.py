"""QK-clip (MuonClip, Kimi K2) maths as Megatron-Core 0.16 / 0.19 implement it, framework-free.

After the optimizer step, every attention layer whose largest pre-softmax logit S (per
head, over the step's whole batch) exceeds the threshold tau rescales its query and key
projections, per query group g (GQA: the heads sharing one key):

    eta_g = min(1, tau / max_{heads h of g} S_h)
    W_q rows of g *= eta_g ** alpha,   W_k rows of g *= eta_g ** (1 - alpha),   W_v unchanged

so every logit q . k of the group shrinks by eta_g.  Nothing changes when no group exceeds
tau.  Megatron's fused ``linear_qkv`` weight stores its rows per query group as
[q heads of the group, k, v] (each block ``head_dim`` rows per head); ``qkv_row_scales``
gives the factor of every row in that layout, ``scale_flat_rows`` applies it to a flat
slice of the matrix (a DP shard of the fp32 main param), with the same products as
Megatron's in-place multiplications of the row blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["qk_clip_eta", "qkv_row_scales", "scale_flat_rows", "check_qk_clip_settings"]


def check_qk_clip_settings(threshold: float, alpha: float) -> None:
    """Megatron-LM's own checks of ``--qk-clip-threshold`` / ``--qk-clip-alpha``."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"qk_clip_alpha must be between 0.0 and 1.0, got {alpha}")
    if not threshold > 0:
        raise ValueError(f"qk_clip_threshold must be greater than 0, got {threshold}")


def qk_clip_eta(max_logits: torch.Tensor, num_groups: int,
                threshold: float) -> Optional[torch.Tensor]:
    """Per query group eta (shape [num_groups]) from the per-head max logits (shape
    [heads], the heads of a group adjacent), or None when no group exceeds ``threshold``."""
    grouped = torch.max(max_logits.view(num_groups, -1), dim=1).values
    if not torch.any(grouped > threshold):
        return None
    return torch.clamp(threshold / grouped, max=1.0)


def qkv_row_scales(eta: torch.Tensor, heads_per_group: int, head_dim: int,
                   alpha: float) -> torch.Tensor:
    """The factor of every row of the fused [q..., k, v] x groups weight: eta ** alpha on
    the group's query rows, eta ** (1 - alpha) on its key rows, 1 on its value rows."""
    g = eta.numel()
    q = torch.pow(eta, alpha).view(g, 1).expand(g, heads_per_group * head_dim)
    k = torch.pow(eta, 1 - alpha).view(g, 1).expand(g, head_dim)
    v = torch.ones(g, head_dim, dtype=eta.dtype, device=eta.device)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def scale_flat_rows(flat: torch.Tensor, row_scales: torch.Tensor, start: int, cols: int) -> None:
    """Multiply ``flat`` -- elements [start, start + flat.numel()) of a row-major matrix
    with ``cols`` columns -- by the scale of each element's row, in place."""
    n = flat.numel()
    if n == 0:
        return
    rows = torch.arange(start, start + n, device=flat.device) // cols
    flat.mul_(row_scales.to(flat.device)[rows])
