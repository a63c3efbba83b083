"""`hf-upipe selftest`: check on YOUR model that sequence-parallel training equals training on one device.

Entry points:
- `run_selftest(models, *, sp=2, lora=False, seq_len=61, heads_per_chunk=1, fused=True, breakage=None, ring=1,
  full_size=False, report=None)`: sizes each model to this machine (`size_models`: a reduced copy of its
  architecture unless `full_size`, refused with the numbers when the free memory cannot hold it), spawns `sp`
  processes (gloo on CPU; NCCL when there are `sp` GPUs) and returns one `Check` per comparison and model; a rank
  that raises, dies or hangs raises `RanksFailed` (within seconds of a death).
- `check_inputs(models, sp, heads_per_chunk)`: the input checks made before any process is started.
- `hf-upipe selftest ...`, the command on top, and its table: `hf_upipe.tools.selftest`.
- `--model qwen2_vl` / `qwen2_5_vl`: a tiny vision-language model on images and text, merged whole and then
  sharded (`check_vlm`; SP 2).

Per model, every rank builds the model twice from the same weights: a reference ("sdpa", whole sequence, one
device) and the SP model (`prepare_model`: fused block or registered "upipe", `heads_per_chunk`). Two batches: a
right-padded batch of odd length (SP padding path) and a packed row of three documents (positions restarting).
Checked against the reference, in fp32: the logits of every real token of this rank's shard, the training loss
(token mean over all ranks, `hf_upipe.shard_batch` + the tiled loss), every parameter gradient summed over the
ranks, and the eval loss (no_grad). A model directory with weights is loaded; a config or a name gets random
weights (fine for checking the parallel math). `breakage="shard-shift"` deliberately shifts the labels inside each
shard, the classic SP bug, to show that the test fails loudly.

`hf-upipe selftest`: the command line of the self-test (`hf_upipe.tools.selftest`) and the table it prints.

Entry points:
- `hf-upipe selftest --model <name | config.json | model dir | org/name> [--sp 2] [--ring 1] [--lora]`: the names of
  `hf_upipe.models.presets` (presets run at a tiny width and depth with their own head geometry); a reduced copy of the
  architecture unless `--full-size` (`hf_upipe.tools.selftest_size`). Exit codes: `EXIT_CODES`.
  `add_arguments(parser)` declares its flags, `run(args)` runs it (`hf_upipe.cli`).
- `format_table(checks)`: the pass/fail table the command prints.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_upipe.models.peft import base_model
from hf_upipe.models.presets import runnable_config
from hf_upipe.ops.head_layout import geometry_error, valid_heads_per_chunk, valid_sp_sizes
from hf_upipe.ops.ring import ring_positions
from hf_upipe.tools.selftest_size import (
    DoesNotFit,
    RunShape,
    available_memory,
    check_fits,
    model_has_weights,
    size_model,
)
from hf_upipe.tools.testing import DistributedFailure, run_distributed

__all__ = [
    "Check",
    "EXIT_CODES",
    "RanksFailed",
    "add_arguments",
    "check_model",
    "format_table",
    "raised_by_hf_upipe",
    "run",
    "run_selftest",
    "size_models",
]

EXIT_CODES = {  # docs/selftest.md lists them
    0: "every check passed",
    1: "a numerical mismatch: a check failed",
    2: "bad input, or a model hf_upipe refuses to run under sequence parallelism",
    3: "does not fit: the model needs more memory than this machine has available; nothing was built",
    4: "a rank failed: it died (killed by a signal: 9 is SIGKILL, likely out of memory), exited, raised an error "
    "hf_upipe does not own, or did not answer in time; no numerical verdict",
}


def format_table(checks: list[Check]) -> str:
    rows = [
        "| model | batch | check | max rel. error | tolerance | result |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        if c.refused:
            continue
        rows.append(
            f"| {c.model} | {c.batch} | {c.name} | {c.error:.2e} | {c.tolerance:.0e} | "
            f"{'PASS' if c.passed else 'FAIL'}{' (' + c.note + ')' if c.note and not c.passed else ''} |"
        )
    failed = sum(not c.passed and not c.refused for c in checks)
    rows.append(
        f"\n{len(checks) - failed - sum(bool(c.refused) for c in checks)} passed, {failed} failed"
    )
    rows += [
        f"{c.model}: cannot run under sequence parallelism: {c.refused}"
        for c in checks
        if c.refused
    ]
    rows += [
        f"{m}: not in hf_upipe's architecture registry; these checks verify it for this configuration: train "
        "it with UPipeConfig(allow_unverified=True) or UPIPE_ALLOW_UNVERIFIED=1"
        for m in _unverified(
            {c.model for c in checks if c.passed} - {c.model for c in checks if not c.passed}
        )
    ]
    return "\n".join(rows)


def _unverified(models) -> list[str]:
    """The model names among `models` whose model_type the registry does not list as verified."""
    from hf_upipe.models.architectures import ARCHITECTURES

    out = []
    for name in sorted(models):
        try:
            model_type = runnable_config(name)[0].model_type
        except Exception:  # noqa: BLE001  (only a note: a name that does not resolve here gets none)
            continue
        if not (ARCHITECTURES.get(model_type) and ARCHITECTURES[model_type].verified):
            out.append(name)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="comma-separated: names `hf-upipe plan --model` takes (presets run at a tiny width and depth with "
        "their own type and head geometry), tiny-<model_type> (any causal-LM type built tiny, e.g. tiny-llama), a "
        "config.json, a model folder, or a Hub id 'org/name'",
    )
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks to launch")
    parser.add_argument(
        "--ring",
        type=int,
        default=1,
        help="ring attention over this many ring shards of the --sp ranks (1: none)",
    )
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="test the model at its own size (loading a folder's weights), refused when this machine's free "
        "memory cannot hold it; without it: a reduced copy of the same architecture (fewer layers, narrower), "
        "which runs the same code",
    )
    parser.add_argument(
        "--lora", action="store_true", help="check a LoRA (PEFT) model on all linear layers"
    )
    parser.add_argument(
        "--seq-len", type=int, default=61, help="sequence length (odd: pads under SP)"
    )
    parser.add_argument(
        "--heads-per-chunk", default="1", help="UPipe head chunk, or 'all' (Ulysses mode)"
    )
    parser.add_argument(
        "--registered",
        action="store_true",
        help="check the registered attention, not the fused one",
    )
    parser.add_argument(
        "--break", dest="breakage", choices=["shard-shift"], help="deliberately break the sharding"
    )


def run(args: argparse.Namespace) -> int:
    """The self-test; its exit code (`EXIT_CODES`)."""
    try:
        hpc = None if args.heads_per_chunk == "all" else int(args.heads_per_chunk)
        checks = run_selftest(
            args.model.split(","),
            sp=args.sp,
            lora=args.lora,
            seq_len=args.seq_len,
            heads_per_chunk=hpc,
            fused=not args.registered,
            breakage=args.breakage,
            ring=args.ring,
            full_size=args.full_size,
            report=lambda line: print(f"hf-upipe selftest: {line}", flush=True),
        )
    except DoesNotFit as err:
        print(f"hf-upipe selftest: does not fit: {err}", file=sys.stderr)
        return 3
    except ValueError as err:
        print(f"hf-upipe selftest: error: {err}", file=sys.stderr)
        return 2
    except RanksFailed as err:
        print(f"{err}\n\nhf-upipe selftest: {_failure_line(err)}", file=sys.stderr)
        return 4
    print(format_table(checks))
    if any(c.refused for c in checks):
        return 2
    return 0 if all(c.passed for c in checks) else 1


def _failure_line(err: RanksFailed) -> str:
    """One line naming the failed ranks and how each failed (the tracebacks are above it)."""
    from hf_upipe.tools.testing import death_cause

    said = [f"rank {r} {death_cause(code)}" for r, code in sorted(err.died.items())]
    raised = [r for r in err.ranks if r not in err.died]
    if raised:
        said.append(
            f"rank{'s' if len(raised) > 1 else ''} {', '.join(map(str, raised))} raised an error (above)"
        )
    if not said:
        said.append("no rank answered in time")
    return "a rank failed, no numerical verdict: " + "; ".join(said) + " (exit 4)"


TOLERANCE = {"logits": 1e-4, "train loss": 2e-5, "eval loss": 2e-5, "gradients": 1e-4}

GRADIENT_FLOOR = 1e-2  # see gradient_error


class RanksFailed(RuntimeError):
    """A rank of the self-test raised, died (`died`: rank -> exit code; -9: killed, likely out of memory) or did
    not answer: no numerical verdict. The message names each rank and the cause."""

    def __init__(self, message: str, ranks=(), died=None):
        super().__init__(message)
        self.ranks = list(ranks)
        self.died = dict(died or {})


@dataclass
class Check:
    model: str
    batch: str
    name: str
    error: float
    tolerance: float
    note: str = ""
    refused: str = ""  # the model cannot run under SP at all: hf_upipe's error, whole (not a numerical failure)
    crashed: str = (
        ""  # another exception (only recorded with `tolerant=True`: the architecture matrix)
    )

    @property
    def passed(self) -> bool:
        return not self.refused and not self.crashed and self.error <= self.tolerance


def _build(model: str, config=None):
    """`model` in fp32: `config` (sized by the caller: `hf_upipe.tools.selftest_size`) with random weights, else the
    folder's weights, else the name's config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if config is None and model_has_weights(model):
        return AutoModelForCausalLM.from_pretrained(
            model, attn_implementation="sdpa", dtype=torch.float32
        )
    if config is None:
        _, config = runnable_config(model)
    try:
        return AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    except ValueError:  # a model without an sdpa path: its own eager attention is the reference
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        )


def check_inputs(models, sp: int, heads_per_chunk: int | None, ring: int = 1) -> None:
    """Every model resolves and its heads split over `sp` ranks (sp / ring with a ring) in chunks of
    `heads_per_chunk`.

    Raises:
        ValueError: the first input that cannot work, with the values that would.
    """
    if sp < 2:
        raise ValueError(
            f"--sp {sp}: the self-test compares sequence parallelism over at least 2 ranks with one "
            "device."
        )
    if ring < 1 or sp % ring:
        raise ValueError(f"--ring {ring} must divide --sp {sp}: sp = ranks per ring shard x ring.")
    sp //= ring  # the heads split over the ranks of a ring shard
    from hf_upipe.vlm import VISION_TYPES

    for name in models:
        if (
            name in VISION_TYPES
        ):  # a tiny model of 4 query / 2 key-value heads (hf_upipe.tools.vlm_check)
            if sp != 2 or ring != 1:
                raise ValueError(
                    f"{name} is checked at --sp 2 without a ring (its tiny model has 2 KV heads)."
                )
            continue
        _, config = runnable_config(name)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if not isinstance(heads, int):
            continue
        why = geometry_error(heads, kv, sp)
        if why is not None:
            raise ValueError(
                f"--sp {sp} cannot split {name}: {why}; --sp values that work: "
                f"{[p for p in valid_sp_sizes(heads, kv, upto=max(8, sp)) if p > 1]}"
            )
        valid = valid_heads_per_chunk(heads, kv, sp)
        if heads_per_chunk is not None and heads_per_chunk not in valid:
            raise ValueError(
                f"--heads-per-chunk {heads_per_chunk} does not fit {name} ({heads} query / {kv} key-value "
                f"heads) on --sp {sp}: use one of {valid} or 'all'"
            )


def _batches(vocab: int, seq_len: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, seq_len), generator=gen)
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, seq_len - seq_len // 4 :] = 0  # right padding in the second row
    padded = {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": (ids * mask).masked_fill(mask == 0, -100),
    }
    lengths = [seq_len // 3, seq_len // 2, seq_len - seq_len // 3 - seq_len // 2]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, S] restarting at every document
    packed_ids = torch.randint(3, vocab, (1, seq_len), generator=gen)
    labels = packed_ids.clone()
    labels[
        0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    ] = -100  # no target at a document start
    return {
        "padded": padded,
        "packed": {"input_ids": packed_ids, "position_ids": pos, "labels": labels},
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def gradient_error(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """A parameter's gradient error: max |got - want| relative to max |want|, but never to less than GRADIENT_FLOOR
    of `scale` (the largest gradient entry of the whole model). A gradient that is zero in exact arithmetic (a key
    bias: softmax ignores a shift shared by all keys) is rounding noise on both sides, and noise over noise says
    nothing; a real gradient that is wrong stays far above the tolerance."""
    return float((got - want).abs().max()) / max(
        float(want.abs().max()), GRADIENT_FLOOR * scale, 1e-30
    )


def _model_pair(name: str, spec: dict, state):
    """(reference, SP model) of `name` in train mode, from the same weights (`spec["lora"]`: with LoRA)."""
    from hf_upipe import UPipeConfig, prepare_model
    from hf_upipe.adapters.support import config_refusal, refusal_error

    config = spec.get("configs", {}).get(name)
    reason = config_refusal(
        config if config is not None else runnable_config(name)[1],
        allow_unverified=state is not None and state.allow_unverified,
        prepared=True,
    )
    if reason is not None:  # prepare_model's refusal (same message), before building
        raise refusal_error(reason)
    ref = _build(name, config)
    if spec["lora"]:
        from peft import LoraConfig

        from hf_upipe.models.peft import get_peft_model

        torch.manual_seed(2)
        ref = get_peft_model(
            ref, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
        )
    sp_model = prepare_model(copy.deepcopy(ref), UPipeConfig(fused_attention=spec["fused"]))
    ref.train()
    sp_model.train()
    return ref, sp_model


def _shift_inside_shards(labels: torch.Tensor, mine: torch.Tensor, pad: int) -> torch.Tensor:
    """The classic SP bug (`breakage="shard-shift"`): this rank's [B, s] labels shifted inside its shard."""
    padded = torch.nn.functional.pad(labels, (0, pad), value=-100)  # [B, s * world]
    local = padded[:, mine]  # [B, s]
    return torch.cat([local[:, 1:], torch.full_like(local[:, :1], -100)], dim=1)  # [B, s]


def _gradient_check(name: str, batch_name: str, ref, sp_model) -> Check:
    """Every parameter gradient of `sp_model` summed over the ranks against `ref`'s: the worst one."""
    worst, where = 0.0, ""
    pairs = [
        (pname, p.grad, q.grad)
        for (pname, p), (_, q) in zip(ref.named_parameters(), sp_model.named_parameters())
        if p.grad is not None
    ]
    scale = max(float(want.abs().max()) for _, want, _ in pairs)
    for pname, want, got in pairs:
        g = got.clone() if got is not None else torch.zeros_like(want)
        dist.all_reduce(g)
        err = gradient_error(g, want, scale)
        worst, where = (err, pname) if err > worst else (worst, where)
    return Check(name, batch_name, "gradients", worst, TOLERANCE["gradients"], f"worst: {where}")


def _logits_check(
    name: str, batch_name: str, logits: torch.Tensor, ref_logits: torch.Tensor, full: dict, mine
) -> Check:
    """This rank's [B, s, V] shard logits on its real tokens against the reference's [B, S, V]."""
    S = full["input_ids"].shape[1]
    # local indices of this rank's tokens of the unpadded batch
    here = torch.nonzero(mine < S).flatten()
    mask = full.get("attention_mask", torch.ones_like(full["input_ids"]))[:, mine[here]].bool()
    want = ref_logits[:, mine[here]][mask]
    return Check(name, batch_name, "logits", _rel(logits[:, here][mask], want), TOLERANCE["logits"])


def _check_batch(
    name: str,
    batch_name: str,
    full: dict,
    shard: dict,
    ref,
    sp_model,
    spec: dict,
    state,
    rank: int,
    world: int,
) -> list[Check]:
    """One batch's train loss, gradients, logits and eval loss: SP model on `shard`, `ref` on `full`."""
    from hf_upipe import without_sequence_parallel
    from hf_upipe.training.loss import shard_loss_sum

    with without_sequence_parallel():  # one process, the whole sequence
        out = ref(**full)  # transformers' loss: mean over the label tokens of the whole batch
    out.loss.backward()
    s, S = shard["input_ids"].shape[1], full["input_ids"].shape[1]
    # this rank's tokens (contiguous without a ring)
    mine = ring_positions(rank, s, world, state.ring_size)
    if spec.get("breakage") == "shard-shift":  # the classic bug: labels shifted inside each shard
        shard["shift_labels"] = _shift_inside_shards(full["labels"], mine, s * world - S)
    inputs = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
    n = float(shard["num_label_tokens"])
    loss_sum, _ = shard_loss_sum(sp_model, inputs, shard["shift_labels"])
    (loss_sum / n).backward()
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    train_err = _rel(total / n, out.loss.detach())
    checks = [Check(name, batch_name, "train loss", train_err, TOLERANCE["train loss"])]
    checks.append(_gradient_check(name, batch_name, ref, sp_model))
    with torch.no_grad():
        logits = sp_model(**inputs).logits  # [B, s, V]
        checks.append(_logits_check(name, batch_name, logits, out.logits.detach(), full, mine))
        eval_sum, _ = shard_loss_sum(sp_model, inputs, shard["shift_labels"])
        dist.all_reduce(eval_sum)
        with without_sequence_parallel():
            ref_eval = ref(**full).loss
        eval_err = _rel(eval_sum / n, ref_eval)
        checks.append(Check(name, batch_name, "eval loss", eval_err, TOLERANCE["eval loss"]))
    return checks


def check_model(name: str, spec: dict, rank: int, world: int) -> list[Check]:
    """This rank's checks of one model: per batch, the SP model against one device (`_check_batch`)."""
    from hf_upipe import get_sequence_parallel_state, shard_batch
    from hf_upipe.vlm import VISION_TYPES

    if name in VISION_TYPES:  # images merged whole, then the sequence sharded (hf_upipe.vlm)
        return check_vlm(name, spec)
    state = get_sequence_parallel_state()
    ref, sp_model = _model_pair(name, spec, state)
    vocab = base_model(ref).get_output_embeddings().weight.shape[0]
    checks = []
    for batch_name, full in _batches(vocab, spec["seq_len"]).items():
        ref.zero_grad()
        sp_model.zero_grad()
        try:
            shard = shard_batch(full, rank, world)
        except ValueError as err:  # a ring refuses packed rows: check it says so (on every rank)
            if state.ring_size == 1:
                raise
            checks.append(
                Check(name, batch_name, "refused clearly", 0.0, 0.0, note=str(err).split(":")[0])
            )
            continue
        checks += _check_batch(
            name, batch_name, full, shard, ref, sp_model, spec, state, rank, world
        )
    return checks


def _rank(rank: int, world: int, spec: dict) -> list[dict]:
    """One rank of the self-test: every model's checks (a model that cannot run under SP: one failed check)."""
    import hf_upipe

    hf_upipe.init_sequence_parallel(
        world,
        ring_size=spec.get("ring", 1),
        heads_per_chunk=spec["heads_per_chunk"],
        allow_unverified=spec.get("allow_unverified", True),
    )
    checks = []
    for name in spec["models"]:
        try:
            checks += check_model(name, spec, rank, world)
        except Exception as err:
            said = f"{type(err).__name__}: {err}"
            if isinstance(err, (ValueError, NotImplementedError)) and raised_by_hf_upipe(err):
                checks.append(
                    Check(name, "-", "runs under SP", float("nan"), 0.0, refused=said)
                )  # said whole
            elif spec.get("tolerant"):
                checks.append(Check(name, "-", "runs under SP", float("nan"), 0.0, crashed=said))
            else:
                raise
    return [vars(c) for c in checks]


def raised_by_hf_upipe(err: BaseException) -> bool:
    """Whether the innermost frame of `err`'s traceback is hf_upipe's own code (a deliberate refusal)."""
    from hf_upipe.exits import raised_in_hf_upipe

    return raised_in_hf_upipe(err)


def size_models(models, run: RunShape, report=None) -> dict:
    """{name: the config its ranks build} for the text models among `models`, each sized to this machine
    (`hf_upipe.tools.selftest_size`: a reduced copy unless `run.full_size`) and checked against the memory available
    before anything is built; `report(line)` gets what is built and the memory it needs.

    Raises:
        DoesNotFit: a model needs more memory than this machine has free (a ValueError; the numbers).
    """
    from hf_upipe.vlm import VISION_TYPES

    available, source = available_memory()
    configs = {}
    for name in models:
        if name in VISION_TYPES:  # a tiny model by construction (hf_upipe.tools.vlm_check)
            continue
        sized = size_model(name, runnable_config(name)[1], run)
        line = check_fits(sized, run, available, source)
        if sized.changes:
            weights = (
                "; random weights (the folder's are loaded with --full-size)"
                if model_has_weights(name)
                else ""
            )
            line += (
                f"\n{name}: testing a reduced copy of its architecture, which runs the same code: "
                f"{', '.join(sized.changes)}; every other setting as configured{weights}. "
                "--full-size tests the model at its own size."
            )
        if report is not None:
            report(line)
        # a folder with weights at full size: its weights are loaded (`_build`)
        configs[name] = None if not sized.changes and model_has_weights(name) else sized.config
    return configs


def run_selftest(
    models,
    *,
    sp: int = 2,
    lora: bool = False,
    seq_len: int = 61,
    heads_per_chunk: int | None = 1,
    fused: bool = True,
    breakage: str | None = None,
    timeout: float = 600,
    tolerant: bool = False,
    start_method: str = "spawn",
    allow_unverified: bool = True,
    ring: int = 1,
    full_size: bool = False,
    report=None,
) -> list[Check]:
    """Spawn `sp` ranks and compare each model under SP with one device; returns rank 0's checks (the gradients,
    losses and eval losses are global; logits are rank 0's shard, and every rank asserts nothing on its own).

    Each model is sized first (`size_models`: a reduced copy of its architecture unless `full_size`, refused with
    `DoesNotFit` when this machine's free memory cannot hold it; `report(line)` hears what is built).
    `allow_unverified=True` (the default: checking a model the registry does not list is what the self-test is for)
    runs an architecture hf_upipe has not verified; every other refusal of the support gate still applies.

    Raises:
        ValueError: bad input (`check_inputs`), or `DoesNotFit`.
        RanksFailed: a rank raised, died or did not answer (within seconds of a death, not after `timeout`).
    """
    if breakage not in (None, "shard-shift"):
        raise ValueError(f"breakage={breakage!r}: the only deliberate breakage is 'shard-shift'.")
    check_inputs(models, sp, heads_per_chunk, ring)
    shape = RunShape(sp, heads_per_chunk, ring, lora, seq_len, full_size)
    spec = dict(
        models=list(models),
        configs=size_models(models, shape, report),
        lora=lora,
        seq_len=seq_len,
        heads_per_chunk=heads_per_chunk,
        fused=fused,
        breakage=breakage,
        tolerant=tolerant,
        allow_unverified=allow_unverified,
        ring=ring,
    )
    try:
        ranks = run_distributed(_rank, sp, spec, timeout=timeout, start_method=start_method)
    except DistributedFailure as err:
        raise RanksFailed(f"selftest worker failed:\n{err}", err.ranks, err.died) from None
    return [Check(**c) for c in ranks[0]]


def check_vlm(model_type: str, spec: dict) -> list:
    """The self-test's rows for a vision-language type (`--lora`: LoRA on the language model, the vision tower
    trained too): a tiny model, a padded batch with images and a video (`hf_upipe.tools.vlm_check.vlm_step`)."""
    from hf_upipe.prepare import prepare_model
    from hf_upipe.tools.vlm_check import tiny_batch, vlm_pair, vlm_step

    ref, model = vlm_pair(model_type, spec.get("lora", False), seed=0)
    prepare_model(model)
    errors = vlm_step(model, ref, tiny_batch(1, padded=True, video=True))
    grads = {k: v for k, v in errors.items() if k not in ("loss", "logits")}
    worst = max(grads, key=grads.get)
    vision = max(v for k, v in grads.items() if ".visual." in k)
    batch = "images+video+text"
    return [
        Check(model_type, batch, "logits", errors["logits"], TOLERANCE["logits"]),
        Check(model_type, batch, "train loss", errors["loss"], TOLERANCE["train loss"]),
        Check(
            model_type, batch, "gradients", grads[worst], TOLERANCE["gradients"], f"worst: {worst}"
        ),
        Check(model_type, batch, "vision-tower gradients", vision, TOLERANCE["gradients"]),
    ]
