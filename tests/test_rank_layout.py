"""`hf_upipe.rank_layout`: the groups of every valid (world, sp_size, ring_size) up to 16 ranks, without processes;
and the same groups from torch's `init_device_mesh` over its `mesh_shape` (a fake process group, one process)."""

import pytest

from hf_upipe.rank_layout import MESH_DIM_NAMES, rank_layout


def _valid(max_world=16):
    for world in range(1, max_world + 1):
        for sp in (d for d in range(1, world + 1) if world % d == 0):
            for ring in (d for d in range(1, sp + 1) if sp % d == 0):
                yield world, sp, ring


def _partitions(groups, world, size):
    """Each rank in exactly one group; every group `size` ranks, increasing."""
    ranks = sorted(r for g in groups for r in g)
    assert ranks == list(range(world)), groups
    assert all(len(g) == size and list(g) == sorted(g) for g in groups), groups


@pytest.mark.parametrize("world,sp,ring", list(_valid()))
def test_every_valid_layout(world, sp, ring):
    layout = rank_layout(world, sp, ring)
    dp, U = world // sp, sp // ring
    assert (layout.dp_size, layout.ulysses_size, layout.mesh_shape) == (dp, U, (dp, ring, U))
    _partitions(layout.sp_groups, world, sp)
    # SP groups are contiguous ranks, in order
    assert [g[0] for g in layout.sp_groups] == list(range(0, world, sp))
    assert all(g == tuple(range(g[0], g[0] + sp)) for g in layout.sp_groups)
    if dp > 1:  # DP: the ranks at the same place of every SP group
        _partitions(layout.dp_groups, world, dp)
        assert all(g == tuple(range(i, world, sp)) for i, g in enumerate(layout.dp_groups))
    else:
        assert layout.dp_groups == ()
    if ring > 1:
        _partitions(layout.ulysses_groups, world, U)
        _partitions(layout.ring_groups, world, ring)
        for g in layout.ulysses_groups:  # contiguous, inside one SP group
            assert g == tuple(range(g[0], g[0] + U)) and g[0] // sp == g[-1] // sp
        for g in layout.ring_groups:  # stride U inside one SP group
            assert all(b - a == U for a, b in zip(g, g[1:])) and g[0] // sp == g[-1] // sp
    else:
        assert layout.ulysses_groups == layout.ring_groups == ()
    for rank in range(world):
        mine = layout.groups_of(rank)
        g, r = divmod(rank, sp)  # SP group g, SP rank r = j * U + u
        j, u = divmod(r, U)
        assert mine["sp"] == layout.sp_groups[g]
        assert mine["dp"] == (layout.dp_groups[r] if dp > 1 else None)
        if ring > 1:
            assert mine["ulysses"] == tuple(g * sp + j * U + x for x in range(U))
            assert mine["ring"] == tuple(g * sp + u + U * x for x in range(ring))
            # a ring group and a Ulysses group meet in exactly this rank
            assert set(mine["ring"]) & set(mine["ulysses"]) == {rank}


def test_the_documented_example():
    """8 ranks, SP 4, ring 2: SP {0-3}, {4-7}; Ulysses {0,1}, {2,3}, ...; ring {0,2}, {1,3}, ...; DP {0,4}, ..."""
    layout = rank_layout(8, 4, 2)
    assert layout.sp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.ulysses_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.ring_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.dp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize(
    "world,sp,ring,message",
    [
        (8, 3, 1, "sp_size=3 does not divide the world size 8; use one of [1, 2, 4, 8]"),
        (8, 0, 1, "sp_size=0 does not divide"),
        (8, 4, 3, "ring_size=3 does not divide sp_size=4; use one of [1, 2, 4]"),
        (8, 4, 0, "ring_size=0 does not divide"),
    ],
)
def test_sizes_that_do_not_divide_are_refused(world, sp, ring, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rank_layout(world, sp, ring)


@pytest.mark.parametrize("world,sp,ring", [(16, 8, 2), (12, 6, 3), (8, 2, 2), (4, 4, 1)])
def test_init_device_mesh_over_mesh_shape_gives_the_same_groups(world, sp, ring):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout = rank_layout(world, sp, ring)
    for rank in (0, world - 1, world // 2 + 1 if world > 2 else 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
            mine = layout.groups_of(rank)
            assert tuple(mesh["ring", "ulysses"].mesh.flatten().tolist()) == mine["sp"]
            assert tuple(mesh["dp"].mesh.tolist()) == (mine["dp"] or (rank,))
            assert tuple(mesh["ring"].mesh.tolist()) == (mine["ring"] or (rank,))
            assert tuple(mesh["ulysses"].mesh.tolist()) == (mine["ulysses"] or mine["sp"])
        finally:
            dist.destroy_process_group()


def _created_groups(rank, world):
    import torch.distributed as dist

    import hf_upipe

    out = {}
    for sp, ring in ((2, 2), (4, 2), (2, 1)):
        state = hf_upipe.init_sequence_parallel(sp, ring_size=ring)
        out[(sp, ring)] = {
            kind: None if group is None else tuple(dist.get_process_group_ranks(group))
            for kind, group in (
                ("sp", state.sp_group),
                ("check", state.check_group),
                ("ulysses", state.ulysses_group),
                ("ring", state.ring_group),
                ("dp", state.dp_group),
            )
        }
        hf_upipe.reset_sequence_parallel()
    return out


@pytest.mark.slow
def test_init_sequence_parallel_creates_the_layouts_groups():
    """4 gloo ranks: SP 2 x ring 2 (U = 1) x DP 2, SP 4 x ring 2, SP 2 x DP 2: each rank's process groups hold the
    ranks `rank_layout` gives it (the validation twin those of its SP group)."""
    from tests._dist import run_distributed

    for rank, got in enumerate(run_distributed(_created_groups, 4)):
        for (sp, ring), groups in got.items():
            want = rank_layout(4, sp, ring).groups_of(rank)
            assert groups["check"] == want["sp"], (rank, sp, ring)
            assert {k: v for k, v in groups.items() if k != "check"} == want, (rank, sp, ring)
