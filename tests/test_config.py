"""UPipeConfig: explicit values, UPIPE_* environment fallbacks, defaults, and errors that name the fix."""

import pytest

from hf_upipe import UPipeConfig


def test_defaults(monkeypatch):
    for name in (
        "SP_SIZE",
        "RING_SIZE",
        "HEADS_PER_CHUNK",
        "KERNEL",
        "FUSED_ATTENTION",
        "TILED_LOSS",
        "LOSS_CHUNK_TOKENS",
        "ALLOW_UNVERIFIED",
        "TILED_MLP",
        "MLP_CHUNK_TOKENS",
        "OFFLOAD",
        "OFFLOAD_PATH",
        "FUSED_BACKWARD",
        "OVERLAP_COMM",
        "MIXER_STATE_PASSING",
    ):
        monkeypatch.delenv(f"UPIPE_{name}", raising=False)
    cfg = UPipeConfig()
    assert (
        cfg.sp_size,
        cfg.heads_per_chunk,
        cfg.kernel,
        cfg.fused_attention,
        cfg.tiled_loss,
        cfg.loss_chunk_tokens,
    ) == (None, 1, "auto", True, True, None)
    assert (cfg.tiled_mlp, cfg.mlp_chunk_tokens, cfg.offload, cfg.offload_path) == (
        False,
        None,
        "none",
        None,
    )
    assert cfg.fused_backward == "recompute" and cfg.overlap_comm is False
    assert cfg.mixer_state_passing == "parallel"
    assert cfg.init_kwargs() == {
        "ring_size": 1,
        "heads_per_chunk": 1,
        "kernel": "auto",
        "allow_unverified": False,
    }


def test_ring_size(monkeypatch):
    monkeypatch.setenv("UPIPE_RING_SIZE", "2")
    cfg = UPipeConfig()
    assert cfg.ring_size == 2 and cfg.init_kwargs()["ring_size"] == 2
    assert (
        cfg.resolve_sp_size(16, local_world_size=8) == 16
    )  # UPipe over a node's 8 ranks, a ring of 2 nodes
    assert UPipeConfig(ring_size=1).resolve_sp_size(16, local_world_size=8) == 8
    with pytest.raises(
        ValueError, match=r"UPIPE_RING_SIZE=2 does not divide sp_size=3 .* use one of \[1, 3\]"
    ):
        UPipeConfig(sp_size=3).resolve_sp_size(6)
    with pytest.raises(ValueError, match="ring_size=0 must be a positive integer"):
        UPipeConfig(ring_size=0)


def test_environment_fallbacks_and_explicit_precedence(monkeypatch):
    monkeypatch.setenv("UPIPE_SP_SIZE", "4")
    monkeypatch.setenv("UPIPE_HEADS_PER_CHUNK", "all")
    monkeypatch.setenv("UPIPE_TILED_LOSS", "0")
    monkeypatch.setenv("UPIPE_LOSS_CHUNK_TOKENS", "2048")
    monkeypatch.setenv("UPIPE_KERNEL", "sdpa")
    monkeypatch.setenv("UPIPE_TILED_MLP", "yes")
    monkeypatch.setenv("UPIPE_OFFLOAD", "DISK")
    monkeypatch.setenv("UPIPE_FUSED_BACKWARD", "Save")
    monkeypatch.setenv("UPIPE_OVERLAP_COMM", "true")
    monkeypatch.setenv("UPIPE_MIXER_STATE_PASSING", "Sequential")
    cfg = UPipeConfig()
    assert cfg.mixer_state_passing == "sequential"
    assert (cfg.tiled_mlp, cfg.offload, cfg.fused_backward, cfg.overlap_comm) == (
        True,
        "disk",
        "save",
        True,
    )
    assert (
        cfg.sp_size,
        cfg.heads_per_chunk,
        cfg.tiled_loss,
        cfg.loss_chunk_tokens,
        cfg.kernel,
    ) == (4, "all", False, 2048, "sdpa")
    assert cfg.init_kwargs()["heads_per_chunk"] is None  # Ulysses mode
    explicit = UPipeConfig(sp_size=2, heads_per_chunk=2, tiled_loss=True)
    assert (explicit.sp_size, explicit.heads_per_chunk, explicit.tiled_loss) == (2, 2, True)


def test_resolve_sp_size(monkeypatch):
    monkeypatch.delenv("UPIPE_SP_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert UPipeConfig().resolve_sp_size(16, local_world_size=8) == 8  # one node shares a sequence
    assert (
        UPipeConfig().resolve_sp_size(6, local_world_size=4) == 6
    )  # nodes of unequal use: all processes
    assert UPipeConfig().resolve_sp_size(4) == 4
    assert UPipeConfig(sp_size=2).resolve_sp_size(8) == 2
    with pytest.raises(
        ValueError, match=r"sp_size=3 does not divide the 8 processes.*\[1, 2, 4, 8\]"
    ):
        UPipeConfig(sp_size=3).resolve_sp_size(8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sp_size=0), "sp_size=0 must be a positive integer"),
        (dict(heads_per_chunk="two"), "heads_per_chunk='two' must be a positive integer"),
        (dict(heads_per_chunk=-1), "heads_per_chunk=-1"),
        (dict(kernel="flash3"), "Unknown attention kernel 'flash3'"),
        (dict(tiled_loss="maybe"), "tiled_loss='maybe' is not a boolean"),
        (dict(loss_chunk_tokens=1.5), "loss_chunk_tokens=1.5"),
        (dict(offload="nvme"), "offload='nvme': use 'none', 'cpu'"),
        (dict(fused_backward="keep"), "fused_backward='keep': use 'recompute' .* or 'save'"),
        (dict(mlp_chunk_tokens=0), "mlp_chunk_tokens=0"),
        (
            dict(mixer_state_passing="ring"),
            "mixer_state_passing='ring': use 'parallel' .* or 'sequential'",
        ),
        (dict(overlap_comm="often"), "overlap_comm='often' is not a boolean"),
        (
            dict(overlap_comm=True, fused_attention=False),
            r"UPipeConfig\(overlap_comm=True\) overlaps the fused block's "
            r"all-to-alls, but UPipeConfig\(fused_attention=False\)",
        ),
        (dict(offload_min_bytes=-5), "offload_min_bytes=-5 must be an integer >= 0"),
    ],
)
def test_bad_values_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UPipeConfig(**kwargs)


def test_bad_environment_value(monkeypatch):
    monkeypatch.setenv("UPIPE_SP_SIZE", "eight")
    with pytest.raises(ValueError, match="sp_size='eight'"):
        UPipeConfig()
