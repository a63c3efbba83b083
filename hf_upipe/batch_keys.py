"""The batch keys hf_upipe adds to a model call for packed rows: `hf_upipe.shard_batch` makes them, the attention
paths read them from the call's kwargs, and transformers passes them through to the attention layers.

- `CU_SEQLENS` ("upipe_cu_seqlens"): int32 [N+1], the document boundaries over the flattened padded batch
  [B * S_padded] (row starts are boundaries), the same on every rank of an SP group.
- `MAX_SEQLEN` ("upipe_max_seqlen"): int, the longest document.
- `DOCUMENT_KEYS`: both, in that order.
"""

__all__ = ["CU_SEQLENS", "DOCUMENT_KEYS", "MAX_SEQLEN"]

CU_SEQLENS = "upipe_cu_seqlens"
MAX_SEQLEN = "upipe_max_seqlen"
DOCUMENT_KEYS = (CU_SEQLENS, MAX_SEQLEN)
