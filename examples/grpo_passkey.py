"""GRPO on the passkey task with a verifiable reward, through `hf_upipe.trl.UPipeGRPOTrainer` (TRL's GRPOTrainer
with hf_upipe's sequence parallelism), under `accelerate launch` or plain `python`.

    python examples/grpo_passkey.py                                                                    # 1 process
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/grpo_passkey.py        # SP 2

Each prompt is a row of random lowercase bytes with a passkey "#<digit>;" in its first half, ending with "?"; the
model answers with one token, and the reward is 1 when that token is the passkey's digit, else 0 (a verifiable
reward: no reward model). Under SP 2 the passkey sits in the first rank's shard of the prompt and the "?" in the
last rank's. Every step samples `--num-generations` answers for each of `--prompts-per-step` new prompts (no
prompt is seen twice), so each step's mean reward is measured on prompts the model has not trained on.

The model is the main example's tiny one-layer Llama built from a config, with LoRA through PEFT (rank 32 on every
projection; the random embeddings and lm_head trained fully). A random model puts 10 of its 259 tokens' worth of
probability on the digits, so it almost never answers a digit and GRPO has no reward to learn from. Before GRPO,
a short SFT warm-up (`--format-steps`, a few seconds) teaches it the answer's format only: after the "?" comes a
digit, drawn at random and unrelated to the passkey, so the warm-up teaches no retrieval and GRPO starts at chance
(10%). GRPO alone then teaches the model to read the passkey. The warm-up runs in every process on the same
data with the same seed (no communication); the ranks check that they start GRPO from the same weights.

Training shows a progress bar with the step's mean reward and the mean of the last 20 steps; at the end the adapter
is saved to `<output-dir>/final` (plain PEFT files naming the base model saved in `<output-dir>/base`, loadable
without hf_upipe) and the reward curve to `<output-dir>/reward.png` (with matplotlib). The run's folder is
`runs/grpo_passkey-lora` unless `--output-dir` says otherwise; an earlier run there is refused without
`--overwrite` or `--resume`. A checkpoint (`checkpoint-N`) is saved every `--save-every` steps and at the last step;
`--resume latest` continues from the newest (the warm-up runs again, then the checkpoint's weights replace it), the
reward curve and summary covering every step; a run already at `--steps` is left as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flags import (  # noqa: E402
    check_flags,
    finished,
    grpo_flags,
    latest_checkpoint,
    preflight,
)

if (
    __name__ == "__main__"
):  # a bad flag, an earlier run or nothing to resume: one line, before torch is imported
    preflight(sys.argv[1:], "grpo_passkey")

import torch  # noqa: E402
from _common import (  # noqa: E402
    DIGITS,
    HAYSTACK,
    ByteTokenizer,
    build_model,
    clear_run_dir,
    point_adapter_to_base,
    run,
    run_dir,
    save_base,
)
from tqdm.auto import tqdm  # noqa: E402
from transformers import PrinterCallback, ProgressCallback, TrainerCallback  # noqa: E402

CHANCE = 0.1  # one digit of ten


def passkey_prompts(n: int, length: int, seed: int, random_answers: bool = False):
    """`n` prompts of `length` bytes ("#<digit>;" at a random place in the first half, "?" last) and their answers
    (the passkey's digit; with `random_answers`, a digit drawn independently of it: the warm-up's format-only data).
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(n):
        text = bytearray(rng.choice(HAYSTACK) for _ in range(length - 1)) + b"?"
        key = rng.choice(DIGITS)
        at = rng.randrange(0, length // 2 - 3)
        text[at : at + 3] = b"#" + bytes([key]) + b";"
        answer = rng.choice(DIGITS) if random_answers else key
        rows["prompt"].append(text.decode())
        rows["answer"].append(chr(answer))
    return Dataset.from_dict(rows)


def correct_digit(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """The verifiable reward: 1.0 when the completion starts with the passkey's digit, else 0.0."""
    return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer)]


def warm_up_format(model, args, tokenizer: ByteTokenizer) -> float:
    """SFT on prompts whose answer is a random digit (format only, no retrieval), on every rank alike, before any
    process group exists; the mean loss of its last 5 steps (ln 10 = 2.303 once the digits are uniform)."""
    if not args.format_steps:
        return float("nan")
    data = passkey_prompts(
        args.format_steps * args.format_batch, args.prompt_len, args.seed + 1, random_answers=True
    )
    ids = torch.tensor(
        [tokenizer.encode(p + a) for p, a in zip(data["prompt"], data["answer"])]
    )  # [N, L + 1]
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]  # the answer only
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    attention = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"  # one process, whole rows: no SP here
    model.train()
    losses = []
    try:
        for step in range(args.format_steps):
            rows = slice(step * args.format_batch, (step + 1) * args.format_batch)
            loss = model(input_ids=ids[rows], labels=labels[rows]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    finally:
        model.config._attn_implementation = attention
    return sum(losses[-5:]) / len(losses[-5:])


def same_start_on_every_rank(model) -> None:
    """Refuses GRPO when the ranks' warmed-up weights differ (they are computed apart, on the same data and seed).

    Raises:
        RuntimeError: the trainable weights' sums differ between ranks.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    total = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad])
    low, high = total.sum().clone(), total.sum().clone()
    torch.distributed.all_reduce(low, torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, torch.distributed.ReduceOp.MAX)
    if low != high:
        raise RuntimeError(
            f"the warmed-up weights differ between ranks (sums {low.item()!r} .. {high.item()!r}): run with "
            "--format-steps 0, or with the same number of threads on every rank"
        )


class RewardBar(TrainerCallback):
    """The progress bar (first rank): each step's mean reward and the mean of the last 20; keeps the rewards."""

    def __init__(self):
        self.rewards: dict[int, float] = {}
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, desc="grpo")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards[state.global_step] = logs["reward"]
            if self.bar is not None:
                recent = [self.rewards[s] for s in sorted(self.rewards)[-20:]]
                self.bar.set_postfix(
                    reward=f"{logs['reward']:.2f}", last_20=f"{sum(recent) / len(recent):.2f}"
                )

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


def plot_rewards(rewards: dict[int, float], path: str) -> str | None:
    """The reward curve (each step and a 20-step mean) as a PNG at `path`; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(rewards)
    values = [rewards[s] for s in steps]
    smooth = [
        sum(values[max(0, i - 19) : i + 1]) / len(values[max(0, i - 19) : i + 1])
        for i in range(len(values))
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, lw=0.8, alpha=0.5, label="mean reward of the step")
    ax.plot(steps, smooth, lw=1.5, label="mean of the last 20 steps")
    ax.axhline(CHANCE, ls="--", c="gray", lw=1, label="chance (one digit of ten)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (share of right answers)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    grpo_flags(ap)
    args = ap.parse_args(argv)
    args.full, args.model = False, None  # what the shared helpers read
    check_flags(
        args, "grpo_passkey"
    )  # impossible values (also checked before the imports, as __main__)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from trl import GRPOConfig

    from hf_upipe import UPipeConfig
    from hf_upipe.trl import UPipeGRPOTrainer as GRPOTrainer

    config = UPipeConfig.from_flags(**({"sp_size": args.sp_size} if args.sp_size else {}))
    output_dir = run_dir(
        args, "grpo_passkey"
    )  # an earlier run: refused without --overwrite / --resume
    done = finished(args, output_dir, "grpo_passkey")
    if done is not None:  # resumed at --steps already: nothing trained, nothing written
        if os.environ.get("RANK", "0") == "0":
            print(done)
        return 0
    tokenizer = ByteTokenizer()
    model = build_model(
        None, tokenizer.vocab_size, lora=True, lora_rank=args.lora_rank, seed=args.seed
    )
    t0 = time.perf_counter()
    format_loss = warm_up_format(model, args, tokenizer)
    warm_up_s = time.perf_counter() - t0
    batch = args.prompts_per_step * args.num_generations
    grpo = GRPOConfig(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=batch,  # one SP group's completions per step
        num_generations=args.num_generations,
        max_completion_length=1,  # the answer is one token
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        max_grad_norm=1.0,
        weight_decay=0.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="steps",  # every --save-every steps and the last: --resume latest continues any run
        save_steps=args.save_every or args.steps,
        report_to="none",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        disable_tqdm=True,  # RewardBar draws the bar
        log_level="warning",
    )
    grpo.device  # noqa: B018  (under accelerate launch, the process group is up after this)
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else lambda: None
    clear_run_dir(output_dir, args, grpo.process_index == 0, barrier)
    same_start_on_every_rank(model)
    data = passkey_prompts(args.steps * args.prompts_per_step, args.prompt_len, args.seed)
    bar = RewardBar()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct_digit,
        args=grpo,
        train_dataset=data,
        processing_class=tokenizer.to_hf(),
        callbacks=[bar],
        upipe_config=config,
    )
    for printer in (
        ProgressCallback,
        PrinterCallback,
    ):  # RewardBar replaces the Trainer's bar and lines
        trainer.remove_callback(printer)
    t1 = time.perf_counter()
    latest = args.resume == "latest"  # the newest checkpoint, or none (a first launch)
    trainer.train(
        resume_from_checkpoint=latest_checkpoint(output_dir, "grpo_passkey")
        if latest
        else args.resume
    )
    grpo_s = time.perf_counter() - t1
    final = os.path.join(output_dir, "final")
    trainer.save_model(final)
    if trainer.is_world_process_zero():
        base = save_base(args, tokenizer.vocab_size, output_dir)
        point_adapter_to_base(final, base)
        rewards = {h["step"]: h["reward"] for h in trainer.state.log_history if "reward" in h}
        report(args, rewards, trainer.upipe.state, output_dir, format_loss, warm_up_s, grpo_s)
    trainer.accelerator.wait_for_everyone()  # rank 0 may still be writing: tear the group down together
    trainer.accelerator.end_training()
    return 0


def report(args, rewards, state, output_dir, format_loss, warm_up_s, grpo_s) -> None:
    """The summary line, the plot and the optional JSON (first rank)."""
    steps = sorted(rewards)
    n = min(20, len(steps))
    first = sum(rewards[s] for s in steps[:n]) / n
    last = sum(rewards[s] for s in steps[-n:]) / n
    plot = plot_rewards(rewards, os.path.join(output_dir, "reward.png"))
    print(
        f"SP {state.sp_size} x DP {state.dp_size}; format warm-up: {args.format_steps} SFT steps, loss "
        f"{format_loss:.3f} (a uniform digit: ln 10 = 2.303), {warm_up_s:.0f} s; GRPO: {len(steps)} steps, "
        f"{grpo_s:.0f} s"
    )
    print(
        f"reward: first {n} steps {first:.3f}, last {n} steps {last:.3f} (chance {CHANCE:.3f}); saved "
        f"{output_dir}/final (plain PEFT files)"
        + (f", curve {plot}" if plot else " (pip install matplotlib: a reward curve)")
    )
    if args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(
                {
                    "rewards": rewards,
                    "sp_size": state.sp_size,
                    "dp_size": state.dp_size,
                    "format_loss": format_loss,
                    "seconds": {"warm_up": warm_up_s, "grpo": grpo_s},
                },
                f,
            )


if __name__ == "__main__":
    run(main)
