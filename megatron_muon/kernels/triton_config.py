"""The Triton kernels' tile configuration: a leaf that both the backend registry
(``backends``, which parses ``triton:...`` names without importing triton) and the kernels
(``triton_ns``) use."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TritonConfig"]


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and launch options shared by both kernels.

    ``block`` is the square tile of the symmetric kernel and the M/N tile of the update
    kernel (square so that mirrored tiles line up); ``block_k`` the reduction tile.
    """

    block: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"triton:{self.block}x{self.block_k}:w{self.num_warps}:s{self.num_stages}"

    @staticmethod
    def parse(spec: str) -> "TritonConfig":
        """Parse ``BLOCKxBLOCK_K:wWARPS:sSTAGES`` (the part after ``triton:``)."""
        try:
            tiles, w, s = spec.split(":")
            block, block_k = (int(v) for v in tiles.split("x"))
            if not (w.startswith("w") and s.startswith("s")):
                raise ValueError
            cfg = TritonConfig(block, block_k, int(w[1:]), int(s[1:]))
            if cfg.num_warps < 1 or cfg.num_stages < 1:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad triton config {spec!r}; expected e.g. 'triton:128x64:w8:s3' "
                "(BLOCKxBLOCK_K:wNUM_WARPS:sNUM_STAGES)"
            ) from None
        for v in (cfg.block, cfg.block_k):
            if v < 16 or v & (v - 1):
                raise ValueError(f"bad triton config {spec!r}: tile sizes must be powers of two >= 16")
        return cfg
