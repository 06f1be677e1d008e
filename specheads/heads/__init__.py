"""Drafter heads that sit on the frozen target's hidden states, and their shared checkpoint format."""

from specheads.heads.checkpoint import TargetInfo, load_heads, save_heads
from specheads.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss

__all__ = ["MedusaConfig", "MedusaHeads", "TargetInfo", "load_heads", "medusa_loss", "save_heads"]
