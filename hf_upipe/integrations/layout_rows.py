"""Per-row facts of one rank's shard for the layout check (`hf_upipe.integrations.layout`), and padding across ranks.

Entry points:
- `usable_padding(mask, s)`, `usable_positions(position_ids, s, batch)`: the padding [B, s] and position_ids
  [B, s] the check reads, or None.
- `local_documents(cu, r, s, P, B, device)`: document ids and per-document positions of rank r's tokens.
- `document_facts(state, documents, pos, mask, batch, s, device, expected)`: whether the mask and the positions
  fit the documents (`upipe_cu_seqlens`, or none), and checksums of them.
- `restarts(pos, pad, expected)`: whether positions restart between real tokens (a new document).
- `padding_facts(pad)`: padding only at the end of each row here, any padding, all padding.
- `check_ring_rows_trailing(state, mask, batch, local_len, device, gather)`,
  `check_rows_trailing(mask, batch, device, gather)`: padding continues to the end of each row across the ranks
  (a second, rare all-gather through `gather`, entered by every rank; the same error on every rank).
"""

from __future__ import annotations

import torch

from hf_upipe.integrations.mask_probe import agrees_with_documents
from hf_upipe.ops.documents import cu_seqlens_error, left_padded_rows
from hf_upipe.ops.ring import ring_positions

__all__ = [
    "check_ring_rows_trailing",
    "check_rows_trailing",
    "document_facts",
    "local_documents",
    "padding_facts",
    "restarts",
    "usable_padding",
    "usable_positions",
]


def local_documents(
    cu: torch.Tensor, r: int, s: int, P: int, B: int, device
) -> torch.Tensor | None:
    """Document ids [B, s] and their per-document positions [B, s] of rank r's tokens from the global
    `upipe_cu_seqlens` (boundaries over the flattened [B * P*s] batch); None when it is malformed."""
    cu = cu.to(device=device, dtype=torch.long).reshape(-1)  # [N+1]
    S = s * P
    if cu_seqlens_error(cu, B, S) is not None:
        return None
    g = (
        torch.arange(B, device=device)[:, None] * S + r * s + torch.arange(s, device=device)
    )  # [B, s] flat index
    doc = torch.searchsorted(cu, g, right=True) - 1  # [B, s]
    return torch.stack([doc, g - cu[doc]])  # [2, B, s]


def document_facts(state, documents, pos, mask, batch, s, device, expected):
    """(mask ok, positions ok, documents given, their two checksums, the mask agrees with the documents)."""
    if documents is None:
        mask_ok = mask is None or mask.plain_causal
        pos_ok = pos is not None and bool((pos == expected).all())
        return mask_ok, pos_ok, 0, (0, 0), None
    local = local_documents(
        documents, state.sp_rank, s, state.sp_size, batch, pos.device if pos is not None else device
    )  # [2, B, s] or None
    pos_ok = local is not None and pos is not None and bool((pos == local[1]).all())
    agrees = (
        mask is not None
        and not mask.plain_causal
        and local is not None
        and mask.mask_function is not None
        and agrees_with_documents(mask.mask_function, local[0])
    )
    mask_ok = mask is None or mask.plain_causal or agrees
    cu = documents.reshape(-1).to(torch.long)  # [N+1]
    sums = (
        int(cu.numel()),
        int((cu * (torch.arange(cu.numel(), device=cu.device) % 7919 + 1)).sum()),
    )
    return mask_ok, pos_ok, 1, sums, agrees


def usable_padding(mask, s: int):
    """(padding [B, s] or None, the 2-D attention_mask's length): a mask of another length (the whole sequence's?)
    is named after the gather, not used here."""
    pad = None if mask is None else mask.padding
    mask_len = s if pad is None else int(pad.shape[-1])
    if mask_len != s:
        pad = None
    return pad, mask_len


def usable_positions(position_ids, s: int, batch: int):
    """position_ids as [B, s] when usable; None otherwise (it then fails the position check on every rank, no
    local raise)."""
    if (
        position_ids is not None
        and position_ids.dim() in (1, 2)
        and position_ids.shape[-1] == s
        and position_ids.reshape(-1, s).shape[0] in (1, batch)
    ):
        return position_ids.reshape(-1, s).expand(batch, s)  # [B, s]
    return None


def restarts(pos, pad, expected) -> bool:
    """Between two real tokens, a position that does not continue (in ring order): a new document."""
    if pos is None:
        return False
    jump = pos[:, 1:] - pos[:, :-1] != expected[1:] - expected[:-1]  # [B, s-1]
    return bool((jump if pad is None else jump & pad[:, 1:] & pad[:, :-1]).any())


def padding_facts(pad) -> tuple[bool, bool, bool]:
    """(padding only at the end of each row here, any padding, every row all padding)."""
    if pad is None:
        return True, False, False
    # ones-then-zeros in every row: once a row has a zero, it stays zero
    return not left_padded_rows(pad), bool((~pad).any()), bool((~pad).all())


def check_ring_rows_trailing(state, mask, batch, local_len, device, gather) -> None:
    """With a ring: per row, every padded token comes after every real token in global positions (second, rare
    all-gather of each rank's last real and first padded position per row)."""
    pos = ring_positions(state.sp_rank, local_len, state.sp_size, state.ring_size, device)  # [s]
    real = (
        mask.padding
        if mask is not None and mask.padding is not None
        else torch.ones(batch, local_len, dtype=torch.bool, device=device)
    )  # [B, s], True on real tokens
    last_real = torch.where(real, pos, -1).amax(-1)  # [B]
    first_pad = torch.where(real, local_len * state.sp_size, pos).amin(-1)  # [B]
    every = gather(torch.cat([last_real, first_pad]).long()).view(-1, 2, batch)  # [P, 2, B]
    if bool((every[:, 0].amax(0) > every[:, 1].amin(0)).any()):
        raise ValueError(
            "attention_mask has interior padding across sequence shards (a padded stretch followed by "
            "real tokens): pad on the right (padding_side='right') with labels -100, or do not pad."
        )


def check_rows_trailing(mask, batch, device, gather) -> None:
    """Per-row check that padding starts on one rank and continues to the end (second, rare all-gather)."""
    pad = mask.padding if mask is not None and mask.padding is not None else None
    ones = pad.sum(-1) if pad is not None else torch.full((batch,), -1, device=device)
    length = pad.shape[-1] if pad is not None else 0
    mine = torch.where(
        ones == length, torch.full_like(ones, -1), ones
    ).long()  # -1: row has no padding here
    every = gather(mine)  # [P, B]
    for row in every.t().tolist():
        started = False
        for count in row:
            if started and count != 0:
                raise ValueError(
                    "attention_mask has interior padding across sequence shards (a padded stretch followed by real "
                    "tokens): pad on the right (padding_side='right') with labels -100, or do not pad."
                )
            started = started or count != -1
