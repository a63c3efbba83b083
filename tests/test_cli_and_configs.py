"""`hf-upipe env` reports the stack and the UPIPE_* settings; `hf-upipe fingerprints` the adapters' sources; every
accelerate config in accelerate_configs/ loads."""

import glob
import json
import os

from accelerate.commands.config.config_args import load_config_from_file

from hf_upipe.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_env_json(capsys, monkeypatch):
    monkeypatch.setenv("UPIPE_HEADS_PER_CHUNK", "2")
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["packages"]["torch"] and info["packages"]["transformers"]
    from importlib.metadata import version

    assert info["packages"]["trl"] == version(
        "trl"
    )  # the TRL entry point's peer is listed with the others
    assert "sdpa" in info["attention_kernels_bf16"]["cpu"]
    assert info["distributed_backends"]["gloo"] is True
    assert info["upipe_settings"]["heads_per_chunk"] == 2


def test_env_prints_only_the_settings_fields(capsys, monkeypatch):
    """The table and the JSON list UPipeConfig's fields, not its bookkeeping (the `_origin` of each setting)."""
    import dataclasses

    from hf_upipe.config import UPipeConfig

    monkeypatch.setenv("UPIPE_HEADS_PER_CHUNK", "2")
    assert main(["env"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("UPipe settings"))
    assert "_origin" not in line and "_flags" not in line, line
    assert "heads_per_chunk=2" in line
    assert main(["env", "--json"]) == 0
    names = [f.name for f in dataclasses.fields(UPipeConfig)]
    assert list(json.loads(capsys.readouterr().out)["upipe_settings"]) == names


def test_fingerprints_lists_each_adapter_with_its_recorded_sources(capsys):
    """Every fused architecture appears twice (fused block, tiled MLP), each row with the installed fingerprint and
    the registry's; on a verified release every installed fingerprint is one recorded, and the exit status is 0."""
    from hf_upipe.models.architectures import FUSED, source_fingerprint
    from hf_upipe.models.verification import VERIFIED_RELEASES, installed_release

    code = main(["fingerprints", "--json", "--no-check"])
    rows = json.loads(capsys.readouterr().out)["adapters"]
    by_key = {(r["adapter"], r["subject"]): r for r in rows}
    for arch in FUSED:
        fused = by_key[("fused", arch.model_type)]
        assert fused["fingerprint"] == source_fingerprint(arch, "fused")
        assert fused["recorded"] == list(arch.fused_fingerprints)
        assert by_key[("tiled", arch.model_type)]["recorded"] == list(arch.tiled_fingerprints)
    assert ("rope", "dynamic_rope_update") in by_key
    if installed_release() in VERIFIED_RELEASES:
        assert code == 0 and all(r["fingerprint"] in r["recorded"] for r in rows)
        assert main(["fingerprints", "--no-check"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("transformers ") and len(lines) == len(rows) + 1
        llama = next(x.split() for x in lines if x.split()[:2] == ["fused", "llama"])
        assert llama[2] in llama[3].split(",") and "verified by fingerprint" in " ".join(llama)


def test_env_reports_a_bad_setting(capsys, monkeypatch):
    monkeypatch.setenv("UPIPE_OFFLOAD", "tape")
    assert main(["env"]) == 1
    assert "offload='tape'" in capsys.readouterr().out


def test_accelerate_configs_load():
    files = sorted(glob.glob(os.path.join(ROOT, "accelerate_configs", "*.yaml")))
    assert len(files) >= 4
    seen = {}
    for path in files:
        config = load_config_from_file(path)
        seen[os.path.basename(path)] = (
            str(config.distributed_type),
            config.num_processes,
            config.num_machines,
        )
        with open(path) as f:
            assert f.readline().startswith("#"), (
                f"{path}: the UPipe settings comment must open the file"
            )
    assert seen["fsdp2_1node_8gpu.yaml"] == ("DistributedType.FSDP", 8, 1)
    assert seen["fsdp2_2nodes_8gpu.yaml"] == ("DistributedType.FSDP", 16, 2)
    assert seen["ddp_1node_8gpu.yaml"] == ("DistributedType.MULTI_GPU", 8, 1)
    assert seen["cpu_2proc.yaml"][1] == 2
