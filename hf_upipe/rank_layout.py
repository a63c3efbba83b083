"""Which ranks form which group under sequence parallelism: a pure function of the sizes, no processes.

Entry points:
- `rank_layout(world, sp_size, ring_size=1)`: the `RankLayout` of a world of `world` ranks in SP groups of
  `sp_size` ranks, each split into `ring_size` ring shards; raises ValueError (naming the sizes that would work)
  when a size does not divide. `hf_upipe.init_sequence_parallel` creates its process groups from it.
- `RankLayout`: the groups' rank lists (`sp_groups`, `ulysses_groups`, `ring_groups`, `dp_groups`), `groups_of(rank)`,
  and `mesh_shape` with `MESH_DIM_NAMES`: the same layout as a device mesh, so that
  `torch.distributed.device_mesh.init_device_mesh(device, layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)`
  gives the same DP, ring and Ulysses groups (the SP group is the ("ring", "ulysses") sub-mesh).

The layout, with U = sp_size / ring_size ranks per Ulysses group and dp_size = world / sp_size SP groups: rank
r = g * sp_size + j * U + u is SP group g's rank j * U + u, in Ulysses group (g, j) and ring group (g, u). An SP
group is sp_size neighbouring ranks (one node, where the all-to-alls are cheap), a Ulysses group U neighbouring
ranks inside it, a ring group the ranks u, u + U, ... of an SP group, and a DP group the ranks at the same place of
every SP group (i, i + sp_size, ...). As a mesh: `arange(world).reshape(dp_size, ring_size, U)`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MESH_DIM_NAMES", "RankLayout", "rank_layout"]

MESH_DIM_NAMES = ("dp", "ring", "ulysses")

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankLayout:
    """The rank lists of every group, each group's ranks in increasing order; the groups of a kind in the order
    `init_sequence_parallel` creates them (SP group by SP group)."""

    world: int
    sp_size: int
    ring_size: int
    sp_groups: Groups
    ulysses_groups: Groups  # empty without a ring (ring_size 1): the SP group is the Ulysses group
    ring_groups: Groups  # empty without a ring
    dp_groups: Groups  # empty when dp_size is 1

    @property
    def dp_size(self) -> int:
        return self.world // self.sp_size

    @property
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """(dp_size, ring_size, ulysses_size): the layout as a mesh with dims `MESH_DIM_NAMES`."""
        return (self.dp_size, self.ring_size, self.ulysses_size)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...] | None]:
        """The groups `rank` belongs to, by kind ("sp", "ulysses", "ring", "dp"); None for a kind not built."""
        kinds = {
            "sp": self.sp_groups,
            "ulysses": self.ulysses_groups,
            "ring": self.ring_groups,
            "dp": self.dp_groups,
        }
        return {
            kind: next((g for g in groups if rank in g), None) for kind, groups in kinds.items()
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_layout(world: int, sp_size: int, ring_size: int = 1) -> RankLayout:
    """See the module docstring. ValueError when sp_size does not divide world or ring_size sp_size."""
    if not isinstance(sp_size, int) or sp_size < 1 or world % sp_size != 0:
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world}; use one of {_divisors(world)}."
        )
    if not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
        raise ValueError(
            f"ring_size={ring_size} does not divide sp_size={sp_size}; use one of {_divisors(sp_size)}."
        )
    dp_size, U = world // sp_size, sp_size // ring_size
    sp_groups = tuple(tuple(range(g * sp_size, (g + 1) * sp_size)) for g in range(dp_size))
    ulysses_groups = ring_groups = ()
    if ring_size > 1:
        ulysses_groups = tuple(
            tuple(g * sp_size + j * U + u for u in range(U))
            for g in range(dp_size)
            for j in range(ring_size)
        )
        ring_groups = tuple(
            tuple(g * sp_size + u + U * j for j in range(ring_size))
            for g in range(dp_size)
            for u in range(U)
        )
    dp_groups = ()
    if dp_size > 1:
        dp_groups = tuple(tuple(range(i, world, sp_size)) for i in range(sp_size))
    return RankLayout(world, sp_size, ring_size, sp_groups, ulysses_groups, ring_groups, dp_groups)
