"""Cut collated batches into the per-rank sequence shards that `attn_implementation="upipe"` expects.

Entry points:
- `shard_batch(batch, sp_rank, sp_size, *, ring_size=None, pad_token_id=0, ignore_index=-100)`: pure function (no
  communication) from a full collated batch to this rank's shard: `shift_labels` built over the whole sequence,
  the sequence right-padded to a multiple of `sp_size`, `position_ids` (global, or per document for packed rows),
  every [B, S] tensor sliced to the contiguous shard `[:, r*s:(r+1)*s]` (with a ring: the rank's tokens in ring
  order, `hf_upipe.ops.ring.ring_positions`), `num_label_tokens` of the whole batch for a globally normalised
  loss, and for packed rows the document boundaries `upipe_cu_seqlens` / `upipe_max_seqlen`.

The loader that applies it to every batch, `ShardedDataLoader`, and `sampler_kwargs` live in `hf_upipe.data`.

Loss: pass `shift_labels=shard["shift_labels"]` and `num_items_in_batch=shard["num_label_tokens"]` to transformers'
`ForCausalLMLoss` (or `model(..., labels=shard["shift_labels"], shift_labels=..., num_items_in_batch=...)`, where
`labels` only switches the loss on); each rank's loss is then its share of the full-sequence mean, and the shares
summed over the SP group equal the unsharded loss, whatever sp_size is (no rescaling by sp_size).

Packed rows (several documents per row, as `DataCollatorWithFlattening` produces): a document starts wherever
position_ids do not continue (`position_ids[t] != position_ids[t-1] + 1`, transformers' rule), `seq_idx` changes,
or `cu_seq_lens_q/k` put a boundary; the descriptions given must agree. Each document's position_ids must count
0, 1, 2, ... (they are kept: RoPE needs them); no target crosses a document boundary; padding (the tail added for
sp_size, or right padding of `attention_mask`) belongs to the last document of its row and continues its
positions. Pass the shard's `upipe_cu_seqlens` and `upipe_max_seqlen` to the model with the other keys (they reach
the "upipe" attention function through transformers' kwargs).

Feed a custom training loop this rank's sequence shards: a loader wrapper and the sampler that goes with it.

Entry points:
- `ShardedDataLoader(dataloader, state, *, pad_token_id=0)`: wraps a loader that yields the SAME batch on every
  rank of an SP group and yields `hf_upipe.data.shard_batch(batch, state.sp_rank, state.sp_size)`.
- `sampler_kwargs(state)`: `dict(num_replicas=state.dp_size, rank=state.dp_rank)` for a `DistributedSampler`, so
  ranks of one SP group draw the same samples and different SP groups draw different ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hf_upipe.batch_keys import CU_SEQLENS, MAX_SEQLEN
from hf_upipe.distributed import SequenceParallelState, check_type, get_sequence_parallel_state
from hf_upipe.ops.documents import cu_seqlens_error, left_padded_rows
from hf_upipe.ops.ring import ring_positions

__all__ = ["ShardedDataLoader", "sampler_kwargs", "shard_batch"]


def sampler_kwargs(state: SequenceParallelState) -> dict:
    """`DistributedSampler` arguments that give every rank of one SP group the same samples.

    Args:
        state: from `init_sequence_parallel`.

    Returns:
        `dict(num_replicas=state.dp_size, rank=state.dp_rank)`: one replica per SP group, not per rank.
    """
    return {"num_replicas": state.dp_size, "rank": state.dp_rank}


def _collective_device(group) -> torch.device:
    """CPU for gloo (also "cpu:gloo,cuda:nccl"), the current accelerator for NCCL-like backends."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or torch.accelerator.current_accelerator() is None:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _checksum(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 [4]: B, S, and two position-weighted sums of the token ids (order-sensitive, overflow-free)."""
    flat = ids.reshape(-1).to(device=device, dtype=torch.long)  # [B*S]
    prime = 2_147_483_647
    weights = (torch.arange(flat.numel(), device=device) * 1_000_003 + 12_345) % prime + 1  # [B*S]
    return torch.stack(
        [
            torch.tensor(ids.shape[0], device=device),
            torch.tensor(ids.shape[1], device=device),
            ((flat % prime) * weights % prime).sum(),
            flat.sum(),
        ]
    )


class ShardedDataLoader:
    """Yield this rank's sequence shard of every batch of a loader that gives all SP ranks the same batch.

    Build the wrapped loader so that every rank of one SP group gets the same batches and different SP groups
    get different ones: `DistributedSampler(dataset, **sampler_kwargs(state), seed=...)` (NOT the world size and
    rank, which `DistributedSampler` defaults to), the same seed, batch size and collator on every rank. The
    number of batches per epoch is then the same as plain data parallelism over `state.dp_size` replicas.

    Args:
        dataloader: any iterable of collated batch dicts (`input_ids` [B, S], ...), usually a torch DataLoader.
        state: this rank's `SequenceParallelState`.
        pad_token_id: see `shard_batch`.
        ignore_index: see `shard_batch`.
        check_same_batch: on the first batch of each pass, all-gather a checksum of `input_ids` over
            `state.sp_group` and raise the same ValueError on every rank if the SP ranks got different batches
            (one tiny collective per epoch; every rank must iterate). Skipped when sp_size is 1.
    """

    sampler_kwargs = staticmethod(sampler_kwargs)

    def __init__(
        self,
        dataloader,
        state: SequenceParallelState,
        *,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        check_same_batch: bool = True,
    ):
        self.dataloader = dataloader
        self.state = state
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index
        self.check_same_batch = check_same_batch

    def __len__(self) -> int:
        return len(self.dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped loader's sampler (or loader) `set_epoch`, as `DistributedSampler` needs."""
        for obj in (getattr(self.dataloader, "sampler", None), self.dataloader):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    def __iter__(self):
        state = self.state
        for i, batch in enumerate(self.dataloader):
            if i == 0 and self.check_same_batch and state.sp_size > 1:
                self._verify_same_batch(batch["input_ids"])
            yield shard_batch(
                batch,
                state.sp_rank,
                state.sp_size,
                pad_token_id=self.pad_token_id,
                ignore_index=self.ignore_index,
            )

    def _verify_same_batch(self, ids: torch.Tensor) -> None:
        group = self.state.sp_group
        device = _collective_device(group)
        mine = _checksum(ids, device)
        every = [torch.empty_like(mine) for _ in range(self.state.sp_size)]
        dist.all_gather(every, mine, group=group)  # [P] x [4]
        rows = [tuple(t.tolist()) for t in every]
        if len(set(rows)) > 1:
            differ = [r for r, row in enumerate(rows) if row != rows[0]]
            raise ValueError(
                f"The {self.state.sp_size} ranks of this sequence-parallel group loaded different batches (SP ranks "
                f"{differ} differ from SP rank 0; shapes {[row[:2] for row in rows]}). ShardedDataLoader needs the "
                "same batch on every rank of an SP group: build the sampler with "
                f"DistributedSampler(dataset, **sampler_kwargs(state)) (num_replicas={self.state.dp_size}, "
                f"rank={self.state.dp_rank}), not the world size and rank, with the same seed on every rank."
            )


# Descriptions of the unsharded documents (DataCollatorWithFlattening's flash-attn kwargs, seq_idx): read by
# shard_batch and dropped from the shard (wrong for a shard); packed shards carry `upipe_cu_seqlens` instead.
_FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _check_right_padding(mask: torch.Tensor) -> None:
    """Raise unless every row of the [B, S] mask is ones then zeros."""
    rows = left_padded_rows(mask)
    if rows:
        raise ValueError(
            f"attention_mask rows {rows} have left or interior padding (a 0 before a 1), which sequence-parallel "
            "'upipe' attention cannot honour: tokenize/collate with padding_side='right' (tokenizer.padding_side = "
            "'right'), or do not pad."
        )


def _starts_from_cu(cu: torch.Tensor, key: str, B: int, S: int) -> torch.Tensor:
    """[B, S] bool document starts from flash-attn `cu_seq_lens` over the flattened [B*S] batch."""
    c = cu.reshape(-1).long()
    error = cu_seqlens_error(c, B, S)
    if error is not None:
        raise ValueError(f"{key} (boundaries over the flattened batch) {error}.")
    flat = torch.zeros(B * S, dtype=torch.bool, device=c.device)
    flat[c[:-1]] = True
    return flat.view(B, S)


def _document_starts(batch: dict, pos, real: torch.Tensor) -> torch.Tensor:
    """[B, S] bool, True where a document starts on a real token (column 0 always): from position_ids, seq_idx
    and multi-document cu_seq_lens_q/k, which must agree. Padding never starts a document."""
    B, S = real.shape
    first = torch.zeros(B, S, dtype=torch.bool, device=real.device)
    first[:, 0] = True
    found = {}
    if pos is not None:
        found["position_ids"] = torch.cat(
            [first[:, :1], pos[:, 1:] != pos[:, :-1] + 1], dim=1
        )  # [B, S]
    seq_idx = batch.get("seq_idx")
    if torch.is_tensor(seq_idx) and tuple(seq_idx.shape) == (B, S):
        found["seq_idx"] = torch.cat([first[:, :1], seq_idx[:, 1:] != seq_idx[:, :-1]], dim=1)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if (
            torch.is_tensor(batch.get(key)) and batch[key].numel() > 2
        ):  # one document: nothing to describe
            found[key] = _starts_from_cu(batch[key].to(real.device), key, B, S)
    starts = {k: (v.to(real.device) & real) | first for k, v in found.items()}
    if not starts:
        return first
    names = list(starts)
    for other in names[1:]:
        if not torch.equal(starts[other], starts[names[0]]):
            raise ValueError(
                f"{names[0]} and {other} describe different documents (a document starts where "
                "position_ids do not continue, seq_idx changes, or cu_seq_lens has a boundary); "
                "collate them consistently, e.g. with DataCollatorWithFlattening."
            )
    return starts[names[0]]


def _document_positions(starts: torch.Tensor) -> torch.Tensor:
    """[B, S] positions counting 0, 1, ... from each document start (starts[:, 0] must be True)."""
    t = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)  # [B, S]
    return t - torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values


def _check_positions(pos, real: torch.Tensor, starts: torch.Tensor, packed: bool) -> None:
    """Raise unless the given positions (on real tokens) are global (0..S-1) or, packed, 0.. per document."""
    if pos is None:
        return
    expected = _document_positions(starts)  # [B, S]; without packing: 0..S-1
    if not bool(((pos == expected) | ~real).all()):
        if packed:
            raise ValueError(
                "position_ids of a packed batch must count 0, 1, 2, ... inside every document (as "
                "DataCollatorWithFlattening produces): hf_upipe keeps them, and checks them against the "
                "document boundaries under sequence parallelism."
            )
        raise ValueError(
            "position_ids are not 0, 1, ..., S-1 on the real tokens of every row: sequence-parallel attention "
            "needs global positions. Omit position_ids (shard_batch builds them) or pass torch.arange(S)."
        )


def _cu_seqlens(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document starts [B, S_padded] -> (int32 [N+1] boundaries over the flattened [B*S_padded] batch, longest)."""
    flat = torch.nonzero(
        starts.reshape(-1)
    ).flatten()  # [N] start indices (every row start included)
    cu = torch.cat([flat, flat.new_tensor([starts.numel()])])  # [N+1]
    return cu.to(torch.int32), int((cu[1:] - cu[:-1]).max())


def _is_sequence(value, batch_size: int, seq_len: int) -> bool:
    return (
        torch.is_tensor(value)
        and value.dim() >= 2
        and value.shape[0] in (batch_size, 1)
        and value.shape[1] == seq_len
    )


_WHERE = "(state.sp_rank and state.sp_size of init_sequence_parallel)"


def _check_arguments(batch, sp_rank, sp_size, ring_size, pad_token_id, ignore_index) -> None:
    """`shard_batch`'s arguments of the wrong type or range, named with what to pass."""
    if not isinstance(batch, dict):
        raise ValueError(
            f"shard_batch needs the collated batch as a dict ({{'input_ids': [B, S] tensor, 'labels': ...}}), "
            f"got a {type(batch).__name__}."
        )
    check_type("sp_size", sp_size, f"an int >= 1 {_WHERE}", none=False)
    check_type("sp_rank", sp_rank, f"an int in 0 .. sp_size - 1 {_WHERE}", none=False)
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(
            f"sp_rank={sp_rank}, sp_size={sp_size}: need sp_size >= 1 and 0 <= sp_rank < sp_size: pass "
            f"{_WHERE[1:-1]}."
        )
    check_type("ring_size", ring_size, "a positive int dividing sp_size, or None")
    check_type("pad_token_id", pad_token_id, "the int id the sequence is padded with", none=False)
    check_type("ignore_index", ignore_index, "the int label the loss ignores (-100)", none=False)


def _check_tensors(batch: dict, ids) -> tuple[int, int]:
    """(B, S) of `input_ids`, after naming any batch tensor of the wrong kind, dtype or shape."""
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError(
            "shard_batch needs batch['input_ids'] as a [B, S] tensor (collate and pad the batch first), "
            f"got {type(ids).__name__}{'' if ids is None else tuple(getattr(ids, 'shape', ()))}."
        )
    B, S = ids.shape
    for key in ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids"):
        value = batch.get(key)
        if value is None:
            continue
        if not torch.is_tensor(value):
            raise ValueError(
                f"batch['{key}'] is a {type(value).__name__}: pass a [B, S] tensor (collate the batch first, "
                "e.g. with transformers' DataCollatorForLanguageModeling(tokenizer, mlm=False))."
            )
        if value.is_floating_point() or value.is_complex():
            raise ValueError(
                f"batch['{key}'] has dtype {value.dtype}: {key} are integers (torch.long"
                f"{', or bool' if key == 'attention_mask' else ''})."
            )
    for key in ("labels", "shift_labels", "attention_mask"):
        if batch.get(key) is not None and tuple(batch[key].shape) != (B, S):
            raise ValueError(
                f"batch['{key}'] has shape {tuple(batch[key].shape)}, input_ids has {(B, S)}: "
                "collate them to the same [B, S]."
            )
    pos = batch.get("position_ids")
    if pos is not None and (pos.dim() != 2 or pos.shape[0] not in (B, 1) or pos.shape[1] != S):
        raise ValueError(
            f"position_ids has shape {tuple(pos.shape)}; expected [B, S] or [1, S] with B={B}, S={S} "
            "(3-D multimodal RoPE positions are not supported under sequence parallelism)."
        )
    return B, S


def _ring_size(sp_rank: int, sp_size: int, ring_size: int | None) -> int:
    """The ring size to shard for (None: the installed state's, else 1), after checking the rank is this rank's."""
    state = get_sequence_parallel_state()
    if state is not None and sp_size > 1 and (state.sp_size, state.sp_rank) != (sp_size, sp_rank):
        raise ValueError(
            f"shard_batch(sp_rank={sp_rank}, sp_size={sp_size}) but this rank is SP rank {state.sp_rank} "
            f"of {state.sp_size} (init_sequence_parallel): the shards would not cover the sequence. Pass "
            "state.sp_rank and state.sp_size."
        )
    if ring_size is None:
        ring_size = state.ring_size if state is not None and state.sp_size == sp_size else 1
    if not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
        raise ValueError(
            f"ring_size={ring_size!r} must be a positive integer dividing sp_size={sp_size}."
        )
    return ring_size


def _shard_length(S: int, sp_size: int, ring_size: int) -> int:
    """Tokens per rank s: S right-padded to a multiple of sp_size (2 * sp_size with a ring), over sp_size."""
    # a ring cuts the sequence into 2R chunks of U*s/2 tokens
    step = sp_size * (2 if ring_size > 1 else 1)
    return -(-S // step) * step // sp_size


def _slice_sequences(out: dict, take, B: int, S: int, pad: int, fill: dict) -> None:
    """In place: every [B or 1, S, ...] tensor of `out` right-padded by `pad` (with `fill`, else 0;
    `position_ids` are [B, S + pad] already) and cut to this rank's tokens `take`."""
    for key, value in out.items():
        if not _is_sequence(value, B, S + pad if key == "position_ids" else S):
            continue
        if pad and key != "position_ids":
            tail = value.new_full(
                (value.shape[0], pad, *value.shape[2:]), fill.get(key, 0)
            )  # [B|1, pad, ...]
            value = torch.cat([value, tail], dim=1)  # [B|1, S_padded, ...]
        out[key] = value[:, take].contiguous()  # [B|1, s, ...]


def shard_batch(
    batch: dict,
    sp_rank: int,
    sp_size: int,
    *,
    ring_size: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> dict:
    """This rank's sequence shard of a full collated batch (pure, no communication): contiguous, or with a ring
    its tokens in ring order (`hf_upipe.ops.ring.ring_positions`).

    Every rank of an SP group calls it on the same batch, so every rank takes the same decisions and raises the
    same errors (all checks run on the unsharded batch, before slicing).

    `labels` is dropped: shifting inside a shard would lose the target of each shard's last token (it is the first
    token of the next shard) and mis-align the loss, so the targets are shifted over the whole sequence first and
    returned as `shift_labels`, which transformers' `ForCausalLMLoss` uses without shifting again.

    Args:
        batch: `input_ids` [B, S]; optional `labels` [B, S] (unshifted, HF convention), `shift_labels` [B, S]
            (already shifted; then `labels` is ignored), `attention_mask` [B, S] (right padding only),
            `position_ids` [B or 1, S] (0..S-1 on real tokens, or 0.. per document for packed rows), and for
            packed rows optionally `seq_idx` [B, S] / `cu_seq_lens_q/k` [N+1] (DataCollatorWithFlattening; read,
            then dropped with `max_length_q/k`). Other tensors shaped [B or 1, S, ...] are padded with 0 and
            sliced; everything else is passed through unchanged.
        sp_rank: this rank's index in its SP group.
        sp_size: ranks in the SP group.
        ring_size: R of `init_sequence_parallel(ring_size=R)`; default: the installed state's (else 1). With R > 1
            the sequence is padded to a multiple of 2*sp_size and each rank takes `ring_positions` (two mirrored
            chunks per ring shard, for causal load balance); packed rows are refused.
        pad_token_id: id used to right-pad `input_ids` to a multiple of `sp_size` (2*sp_size with a ring).
        ignore_index: label value ignored by the loss (transformers: -100).

    Returns:
        A new dict with every sequence tensor shaped [B or 1, S_padded // sp_size, ...], `position_ids` [B, s]
        global (rank r: r*s .. r*s+s-1), `shift_labels` [B, s] if labels were given, and `num_label_tokens` (0-dim
        long: targets != ignore_index in the WHOLE batch; only with labels). Packed rows: `position_ids` are the
        per-document ones (padding continues the last document), `shift_labels` is ignore_index on the last token
        of every document (given `shift_labels` too), and two more keys, identical on every rank:
        `upipe_cu_seqlens` (int32 [N+1], document boundaries over the flattened padded batch [B * S_padded]; row
        starts are boundaries) and `upipe_max_seqlen` (int, the longest document).

    Raises:
        ValueError: bad rank/size (or one that is not this rank's, when `init_sequence_parallel` installed a state),
            missing or non-2-D `input_ids`, shape mismatches, left/interior padding,
            position_ids that are not global (or, packed, not 0.. per document), or document descriptions
            (position_ids, seq_idx, cu_seq_lens_q/k) that disagree.
    """
    # a collator's BatchEncoding (DataCollatorForLanguageModeling) is a Mapping, not a dict
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    _check_arguments(batch, sp_rank, sp_size, ring_size, pad_token_id, ignore_index)
    ring_size = _ring_size(sp_rank, sp_size, ring_size)
    ids = batch.get("input_ids")
    B, S = _check_tensors(batch, ids)
    pos = batch.get("position_ids")
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padding(mask)
    real = (
        torch.ones(B, S, dtype=torch.bool, device=ids.device) if mask is None else mask.bool()
    )  # [B, S]
    pos = None if pos is None else pos.expand(B, S)  # [B, S]
    starts = _document_starts(batch, pos, real)  # [B, S]
    packed = bool(starts[:, 1:].any())
    _check_positions(pos, real, starts, packed)
    if packed and ring_size > 1:
        raise ValueError(
            f"Packed rows (several documents per row) are not implemented with ring attention "
            f"(ring_size={ring_size}): pad each document to its own row, or use ring_size=1."
        )

    out = {
        k: v
        for k, v in batch.items()
        if k not in _FLASH_KEYS and k not in ("labels", "position_ids")
    }
    # (1) targets shifted over the WHOLE sequence: position t predicts token t+1
    shift = batch.get("shift_labels")
    if shift is None and batch.get("labels") is not None:
        labels = batch["labels"]
        shift = torch.cat([labels[:, 1:], labels.new_full((B, 1), ignore_index)], dim=1)  # [B, S]
        if mask is not None:  # a target that is padding is no target
            target_real = torch.cat([real[:, 1:], real.new_zeros(B, 1)], dim=1)  # [B, S]
            shift = shift.masked_fill(~target_real, ignore_index)
    if shift is not None and packed:  # the last token of a document predicts nothing
        shift = shift.masked_fill(
            torch.cat([starts[:, 1:], starts.new_zeros(B, 1)], dim=1), ignore_index
        )
    if shift is not None:
        out["shift_labels"] = shift
        out["num_label_tokens"] = (shift != ignore_index).sum().to(torch.long)  # 0-dim, whole batch

    # (2) right-pad to a multiple of sp_size; (3) global positions, or per-document ones continuing the last
    # document of each row over the padding (also replacing any given ones on padding)
    s = _shard_length(S, sp_size, ring_size)
    pad = s * sp_size - S
    fill = {"input_ids": pad_token_id, "shift_labels": ignore_index, "attention_mask": 0}
    if packed:
        starts = torch.cat([starts, starts.new_zeros(B, pad)], dim=1)  # [B, S_padded]
        out["position_ids"] = _document_positions(starts)  # [B, S_padded]
        out[CU_SEQLENS], out[MAX_SEQLEN] = _cu_seqlens(starts)  # global: the same on every rank
    else:
        out["position_ids"] = torch.arange(S + pad, device=ids.device).expand(
            B, S + pad
        )  # [B, S_padded]
    # (4) this rank's shard of every sequence tensor: contiguous, or its tokens in ring order
    take = (
        slice(sp_rank * s, (sp_rank + 1) * s)
        if ring_size == 1
        else ring_positions(sp_rank, s, sp_size, ring_size, ids.device)
    )
    _slice_sequences(out, take, B, S, pad, fill)
    return out
