"""The architecture matrix's vision-language rows: every image-text-to-text type of the installed transformers, run
under sequence parallelism with images, as a user runs it (the support gate on): exact, refused with hf_upipe's own
error, or (what must never happen) wrong, crashed or hung.

Entry points:
- `vlm_types()`: the model types of transformers' image-text-to-text mapping.
- `vlm_row(model_type, rank, world)`: one rank's row for one type, SP initialised at `world` (2: the tiny batch's
  image crosses the shard boundary there). A type of `hf_upipe.vlm.VISION_TYPES` is built tiny with weights and
  compared with one process by `hf_upipe.tools.selftest.check_vlm` (images, a video and text, row 1 right-padded, row
  0's
  image across the shard boundary; the loss, the shard's logits and every gradient, the vision tower's included),
  classified by `hf_upipe.tools.matrix.classify`. Every other type is built from its config on the meta device (no
  weights: only the refusal is measured, never an output) and run through what a user calls: `prepare_model`,
  then, if it prepared the model, `shard_multimodal_batch` and the forward with pixel inputs. It is "refused" only
  if each of these that runs raises hf_upipe's own ValueError / NotImplementedError (the row keeps each message);
  a step that lets the images through, with no check to compare it, makes it "wrong"; any other error "crashed".
- `vlm_rank(rank, world, types)`: one rank of a job over `types` (the test suite's job); each rank returns its rows.
- `vlm_summary(results)`: the counts of one run; `vlm_support_table(reports)`: docs/models.md's vision-language
  table from one or more runs (`benchmarks/support_table.py`).

`benchmarks/architecture_matrix.py` runs these type by type in isolated processes (a hang is one type's "hung") and
writes them under the report's "vlm" key.
"""

from __future__ import annotations

import time

import torch

__all__ = ["vlm_rank", "vlm_row", "vlm_summary", "vlm_support_table", "vlm_types"]

OUTCOMES = ("exact", "refused", "wrong", "crashed", "hung")


def vlm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _meta_model(model_type: str):
    """(model on the meta device, "tiny" or "default": the config it was built from); its tiny config
    (`hf_upipe.models.presets.tiny_config`: the text sub-config small) first, else the type's default config."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from hf_upipe.models.presets import tiny_config

    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    failure = None
    for how, make in (("tiny", tiny_config), ("default", AutoConfig.for_model)):
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                return cls(make(model_type)), how
        except Exception as err:  # noqa: BLE001  (the next config, or the type does not build here)
            failure = failure or err
    raise failure


def _refused(err: BaseException) -> bool:
    from hf_upipe.tools.selftest import raised_by_hf_upipe

    return isinstance(err, (ValueError, NotImplementedError)) and raised_by_hf_upipe(err)


def _attempt(call) -> str | None:
    """hf_upipe's refusal raised by `call()` ("Type: message"), or None if it returns; any other error is raised."""
    try:
        call()
    except Exception as err:  # noqa: BLE001
        if _refused(err):
            return f"{type(err).__name__}: {err}"
        raise
    return None


def _user_path(model, rank: int, world: int) -> dict:
    """What a user runs under SP with images: `prepare_model`, then (when it prepared the model) the merged batch's
    `shard_multimodal_batch` and the forward with the pixel inputs. Returns {step: its refusal, or None where the
    step let the images through}."""
    from hf_upipe.prepare import prepare_model
    from hf_upipe.tools.vlm_check import tiny_batch
    from hf_upipe.vlm import shard_multimodal_batch

    if (why := _attempt(lambda: prepare_model(model))) is not None:
        return {"prepare_model": why}
    batch = tiny_batch(1, padded=False)
    s = -(-batch["input_ids"].shape[1] // world)  # shard length
    ids = batch["input_ids"][:, rank * s : (rank + 1) * s]  # [B, s]: this rank's shard of the ids
    return {
        "shard_multimodal_batch": _attempt(
            lambda: shard_multimodal_batch(model, batch, rank, world)
        ),
        "forward with pixel_values": _attempt(
            lambda: model(input_ids=ids, pixel_values=batch["pixel_values"])
        ),
    }


def vlm_row(model_type: str, rank: int, world: int) -> dict:
    """See the module docstring."""
    from hf_upipe.tools.matrix import classify
    from hf_upipe.tools.selftest import check_vlm
    from hf_upipe.vlm import VISION_TYPES

    started = time.perf_counter()
    if (
        model_type in VISION_TYPES
    ):  # tiny with weights, every parameter trained, against one process
        try:
            row = {"builds": "tiny", **classify(check_vlm(model_type, {"lora": False}))}
        except Exception as err:  # noqa: BLE001  (classified, not raised: the job goes on)
            outcome = "refused" if _refused(err) else "crashed"
            row = {"builds": "tiny", "sp2": outcome, "sp2_why": f"{type(err).__name__}: {err}"}
    else:
        try:
            model, how = _meta_model(model_type)
        except Exception as err:  # noqa: BLE001
            return {"builds": False, "why": f"{type(err).__name__}: {str(err)[:200]}"}
        row = {"builds": f"{how} config, meta device"}
        try:
            steps = _user_path(model, rank, world)
        except Exception as err:  # noqa: BLE001  (not hf_upipe's refusal)
            row.update(sp2="crashed", sp2_why=f"{type(err).__name__}: {str(err)[:600]}")
        else:
            through = [step for step, why in steps.items() if why is None]
            if through:
                row.update(sp2="wrong", sp2_why=f"{through} let the images through, with no check")
            else:
                row.update(sp2="refused", sp2_why=next(iter(steps.values())), refusals=steps)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def vlm_rank(rank: int, world: int, types: list[str]) -> dict:
    """One rank of a job over `types` at SP `world`, the support gate on: {model_type: row}."""
    import hf_upipe

    hf_upipe.init_sequence_parallel(world)
    return {t: vlm_row(t, rank, world) for t in types}


def vlm_summary(results: dict) -> dict:
    built = [r for r in results.values() if r.get("builds")]
    return {
        "types": len(results),
        "built": len(built),
        "sp2": {o: sum(r.get("sp2") == o for r in built) for o in OUTCOMES},
    }


def _why(row: dict) -> str:
    """The refusal without the common preamble, its first sentence."""
    if row.get("sp2") == "exact":
        return ""
    why = row.get("sp2_why") or row.get("why") or ""
    for preamble in ("hf_upipe: ", "shard_multimodal_batch: "):
        why = why.split(preamble, 1)[-1]
    if "forward with pixel_values" in row.get("refusals", {}):
        why = f"verified for text input only; {why}"
    return why.split(". ")[0].replace("|", "/").replace("\n", " ")


def _cell(results: dict, model_type: str) -> str:
    row = results.get(model_type)
    if row is None:
        return "not in this release"
    if not row.get("builds"):
        return "does not build"
    return row["sp2"] + (f" ({row['sp2_error']:.0e})" if row["sp2"] == "exact" else "")


def vlm_support_table(reports: list[dict]) -> str:
    """Markdown: the counts of each report's "vlm" part (newest release first), then one row per type: its SP 2
    outcome with images on each release (exact: the worst relative error) and the reason on the newest release
    that has it (a refusal's first sentence, or why it does not build)."""
    parts = [(r["transformers"], r["vlm"]) for r in reports if "vlm" in r]
    lines = []
    for version, part in parts:
        n = part["summary"]
        sp2 = ", ".join(f"{n['sp2'][o]} {o}" for o in OUTCOMES)
        lines.append(
            f"- transformers {version}: {n['types']} image-text-to-text types, {n['built']} build; "
            f"at SP 2 with images: {sp2}."
        )
    lines += [
        "",
        "| model_type | "
        + " | ".join(f"SP 2 with images, transformers {v}" for v, _ in parts)
        + " | why refused |",
        "|---|" + "---|" * (len(parts) + 1),
    ]
    for model_type in sorted({t for _, part in parts for t in part["results"]}):
        newest = next(p["results"][model_type] for _, p in parts if model_type in p["results"])
        cells = [model_type, *(_cell(p["results"], model_type) for _, p in parts), _why(newest)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
