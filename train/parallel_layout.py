"""Training a parallel drafter (PARD): every K-token draft of a sequence in one forward.

At decode time the drafter reads the context x_1..x_a and K-1 placeholders m_1..m_{K-1} (positions a+1..a+K-1)
and predicts x_{a+1} at x_a and x_{a+j+1} at m_j. Training packs those queries for many anchors a into one
sequence: the real tokens, then block j = 1..K-1 holding one m_j per anchor, with an attention mask that lets
(a, j) see real tokens up to a and its own anchor's placeholders m_1..m_j (what it will see when decoding), and
position ids a + j. Its label is the target's distribution at position a + j, which predicts x_{a+j+1}.

Conditional drop-token (COD): block j keeps each anchor of block j-1 with probability `keep_rate` (an anchor's
m_j needs its m_1..m_{j-1}), so the packed length is about T / (1 - keep_rate) rather than K * T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelLayout:
    input_ids: torch.Tensor  # [B, L] real tokens, then the placeholder blocks, then padding
    position_ids: torch.Tensor  # [B, L]
    attention: torch.Tensor  # [B, 1, L, L] bool: query slot may attend key slot
    label_position: torch.Tensor  # [B, L] long: the real position whose target distribution labels the slot; -1 none
    block: torch.Tensor  # [B, L] long: 0 for real tokens, j for placeholder m_j, -1 for padding

    @property
    def keep(self) -> torch.Tensor:  # [B, L] bool: the slots the loss reads
        return self.label_position >= 0


def parallel_layout(
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor,  # [B, T]
    labelled: torch.Tensor,  # [B, T] bool: positions whose next token is trained on (assistant tokens)
    k: int,
    mask_token_id: int,
    keep_rate: float = 1.0,
    generator: torch.Generator | None = None,
) -> ParallelLayout:
    """Pack each row's real tokens and K-1 placeholder blocks (COD-subsampled at `keep_rate`); rows are padded to
    the longest. With k = 1 it is the plain causal layout."""
    rows = [_row(input_ids[b], attention_mask[b].bool(), labelled[b], k, keep_rate, generator)
            for b in range(input_ids.shape[0])]
    width = max(r[0].numel() for r in rows)
    batch = input_ids.shape[0]
    ids = torch.full((batch, width), mask_token_id, dtype=torch.long)  # padding: never read
    positions = torch.zeros((batch, width), dtype=torch.long)
    labels = torch.full((batch, width), -1, dtype=torch.long)
    blocks = torch.full((batch, width), -1, dtype=torch.long)
    attention = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1, 1)  # padding slots see only themselves
    for b, (anchor, block, label) in enumerate(rows):
        n = anchor.numel()
        real = block == 0
        ids[b, :n] = torch.where(real, input_ids[b, anchor], torch.full_like(anchor, mask_token_id))
        positions[b, :n] = anchor + block
        labels[b, :n] = label
        blocks[b, :n] = block
        query_anchor, key_anchor = anchor[:, None], anchor[None, :]
        sees_context = real[None, :] & (key_anchor <= query_anchor)
        sees_own_masks = ~real[None, :] & (key_anchor == query_anchor) & (block[None, :] <= block[:, None])
        attention[b, 0, :n, :n] = sees_context | sees_own_masks
    return ParallelLayout(input_ids=ids, position_ids=positions, attention=attention, label_position=labels,
                          block=blocks)


def _row(ids: torch.Tensor, real: torch.Tensor, labelled: torch.Tensor, k: int, keep_rate: float,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchor, block, label position) per slot of one row: T real slots, then each placeholder block."""
    length = ids.numel()
    valid = labelled & real
    anchors, blocks, labels = [torch.arange(length)], [torch.zeros(length, dtype=torch.long)], []
    labels.append(torch.where(valid, torch.arange(length), -1))
    alive = real.clone()  # anchors whose placeholders so far are all present
    for j in range(1, k):
        target = torch.arange(length) + j
        in_range = target < length
        alive &= in_range & valid[target.clamp(max=length - 1)]
        if keep_rate < 1.0:
            alive &= torch.rand(length, generator=generator) < keep_rate
        chosen = alive.nonzero().squeeze(1)
        anchors.append(chosen)
        blocks.append(torch.full_like(chosen, j))
        labels.append(chosen + j)
    return torch.cat(anchors), torch.cat(blocks), torch.cat(labels)
