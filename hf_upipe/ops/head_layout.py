"""Which heads each rank handles at each UPipe stage, and the checks that make a geometry valid.

Entry points:
- `HeadLayout(num_heads, num_kv_heads, sp_size, heads_per_chunk)`: validated geometry; raises ValueError naming the
  numbers and the values that would work.
- `valid_sp_sizes(num_heads, num_kv_heads, upto)`, `valid_heads_per_chunk(num_heads, num_kv_heads, sp_size)`,
  `geometry_error(num_heads, num_kv_heads, sp_size)`.

Legend: H query heads, Hk k/v heads of the model; P ranks (sp_size); r a rank; c = heads_per_chunk.
- k/v replication: when Hk < P, each k/v head is used by rep = P / Hk ranks, so there are Hk_eff = max(Hk, P)
  "effective" k/v heads; effective head e reads model head e // rep (autograd-free index, gradients summed back).
- After the all-to-all, rank r owns query heads [r*H/P, (r+1)*H/P) and effective k/v heads
  [r*Hk_eff/P, (r+1)*Hk_eff/P): the contiguous split of plain Ulysses, under which query head h meets k/v head
  h // (H/Hk) exactly as in the single-device model, so pretrained weights need no permutation.
- Stage i gives rank r its local query heads [i*c, (i+1)*c) of that block, i.e. model heads r*H/P + i*c + j.
  With g = H/Hk_eff query heads per effective k/v head, c must divide g (several stages share one k/v chunk,
  which is sent once, at the group's first stage) or be a multiple of g (each stage sends c/g k/v heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["HeadLayout", "geometry_error", "valid_heads_per_chunk", "valid_sp_sizes"]


def geometry_error(num_heads: int, num_kv_heads: int, sp_size: int) -> str | None:
    """Why `sp_size` ranks cannot split this attention (a sentence with the numbers), or None when they can."""
    if num_heads % num_kv_heads:
        return f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
    if num_heads % sp_size:
        return f"num_attention_heads={num_heads} is not divisible by sp_size={sp_size}"
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        return (
            f"num_key_value_heads={num_kv_heads} and sp_size={sp_size}: neither divides the other, so the k/v heads "
            "can be neither split nor replicated evenly"
        )
    return None


def valid_sp_sizes(num_heads: int, num_kv_heads: int, upto: int = 1024) -> list[int]:
    """Sequence-parallel sizes (<= upto) that the head geometry allows."""
    return [p for p in range(1, upto + 1) if geometry_error(num_heads, num_kv_heads, p) is None]


def valid_heads_per_chunk(num_heads: int, num_kv_heads: int, sp_size: int) -> list[int]:
    """heads_per_chunk values allowed for this geometry (None, all heads in one chunk, is always allowed)."""
    per_rank = num_heads // sp_size
    g = num_heads // max(num_kv_heads, sp_size)
    return [c for c in range(1, per_rank + 1) if per_rank % c == 0 and (g % c == 0 or c % g == 0)]


@dataclass(frozen=True)
class HeadLayout:
    """Validated head geometry of one attention layer under sequence parallelism.

    Args:
        num_heads: H, query heads of the model.
        num_kv_heads: Hk, key/value heads of the model.
        sp_size: P, ranks sharing the sequence.
        heads_per_chunk: c, query heads per rank per stage; None = all H/P local heads in one stage (Ulysses).
    """

    num_heads: int
    num_kv_heads: int
    sp_size: int
    heads_per_chunk: int | None = 1
    # derived, filled in __post_init__
    kv_rep: int = field(init=False)
    q_per_rank: int = field(init=False)
    kv_per_rank: int = field(init=False)
    group: int = field(init=False)
    chunk: int = field(init=False)
    num_stages: int = field(init=False)
    kv_per_stage: int = field(init=False)

    def __post_init__(self) -> None:
        H, Hk, P = self.num_heads, self.num_kv_heads, self.sp_size
        err = geometry_error(H, Hk, P)
        if err is not None:
            raise ValueError(
                f"Sequence parallelism cannot split this attention: {err}. "
                f"sp_size values that work for {H} query / {Hk} key-value heads: "
                f"{valid_sp_sizes(H, Hk, upto=max(64, P))}."
            )
        kv_rep = max(1, P // Hk)
        q_per_rank = H // P
        kv_per_rank = Hk * kv_rep // P
        group = q_per_rank // kv_per_rank
        chunk = q_per_rank if self.heads_per_chunk is None else self.heads_per_chunk
        if chunk < 1 or q_per_rank % chunk or (group % chunk and chunk % group):
            raise ValueError(
                f"heads_per_chunk={self.heads_per_chunk} does not fit {H} query / {Hk} key-value heads on sp_size={P} "
                f"({q_per_rank} query heads per rank, {group} per key-value head): use one of "
                f"{valid_heads_per_chunk(H, Hk, P)}, or None for all local heads in one chunk."
            )
        for name, value in dict(
            kv_rep=kv_rep,
            q_per_rank=q_per_rank,
            kv_per_rank=kv_per_rank,
            group=group,
            chunk=chunk,
            num_stages=q_per_rank // chunk,
            kv_per_stage=max(1, chunk // group),
        ).items():
            object.__setattr__(self, name, value)

    def q_heads(self, stage: int) -> slice:
        """Local (per-rank-block) query heads of `stage`: [stage*c, (stage+1)*c)."""
        return slice(stage * self.chunk, (stage + 1) * self.chunk)

    def kv_group_of(self, stage: int) -> int:
        """Index of the k/v chunk `stage` uses; stages with the same index share one all-to-all of k/v."""
        return stage * self.chunk // (self.group * self.kv_per_stage)

    def starts_kv_group(self, stage: int) -> bool:
        """True for the first stage of each k/v chunk (where k/v are all-to-all'd)."""
        return stage == 0 or self.kv_group_of(stage) != self.kv_group_of(stage - 1)

    def ends_kv_group(self, stage: int) -> bool:
        """True for the last stage of each k/v chunk (where dk/dv are sent back)."""
        return stage == self.num_stages - 1 or self.kv_group_of(stage) != self.kv_group_of(
            stage + 1
        )

    def kv_heads(self, stage: int) -> slice:
        """Local (per-rank-block) effective k/v heads of `stage`."""
        first = self.kv_group_of(stage) * self.kv_per_stage
        return slice(first, first + self.kv_per_stage)

    def kv_source_index(
        self, stage: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor | None:
        """Model k/v heads to send to each rank at `stage`, flattened [P * kv_per_stage], or None when it is the
        regular slice `kv_heads(stage)` of every rank's block (no replication), which needs no index."""
        if self.kv_rep == 1:
            return None
        first = self.kv_heads(stage).start
        eff = [
            r * self.kv_per_rank + first + j
            for r in range(self.sp_size)
            for j in range(self.kv_per_stage)
        ]
        return torch.tensor([e // self.kv_rep for e in eff], dtype=torch.long, device=device)
