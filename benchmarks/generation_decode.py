"""Decode-step time of `hf_upipe.generate` against the SP size, as a ratio to transformers' `model.generate` in one
process on the same prompt (CPU, gloo, fp32, a random-weight Llama-shaped model built from its config).

A decode step's time is (time of 1 + n new tokens - time of 1 new token) / n, each the best of `--repeats` runs,
so the prefill cancels out. Every rank runs the new token through the whole model (its cache is 1/P of the
prompt's keys), so on a machine with fewer cores than ranks the ranks share cores.

    PYTHONPATH=$PWD python benchmarks/generation_decode.py --prompt 4096 --sizes 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results", "generation_decode.json")


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1 << 20,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="upipe").eval()


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _step_time(generate, new: int, repeats: int) -> float:
    return (_best(lambda: generate(1 + new), repeats) - _best(lambda: generate(1), repeats)) / new


def _one_process(prompt: int, new: int, repeats: int) -> float:
    import hf_upipe  # noqa: F401  (registers "upipe": "sdpa" without sequence parallelism)

    model = _model()
    ids = torch.randint(3, 2048, (1, prompt), generator=torch.Generator().manual_seed(1))

    def generate(n):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return _step_time(generate, new, repeats)


def _worker(rank: int, world: int, prompt: int, new: int, repeats: int) -> float:
    import hf_upipe

    torch.set_num_threads(1)
    hf_upipe.init_sequence_parallel(world)
    model = _model()
    hf_upipe.prepare_model(model)
    ids = torch.randint(3, 2048, (1, prompt), generator=torch.Generator().manual_seed(1))

    def generate(n):
        hf_upipe.generate(model, ids, max_new_tokens=n, eos_token_id=[])

    seconds = _step_time(generate, new, repeats)
    hf_upipe.reset_sequence_parallel()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--new", type=int, default=16, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    from hf_upipe.tools.testing import run_distributed

    torch.set_num_threads(1)  # the ranks run one thread each too
    one = _one_process(args.prompt, args.new, args.repeats)
    rows = [{"sp_size": 1, "step_ms": one * 1e3, "ratio": 1.0}]
    for size in args.sizes:
        per_rank = run_distributed(_worker, size, args.prompt, args.new, args.repeats, timeout=1200)
        step = max(per_rank)
        rows.append({"sp_size": size, "step_ms": step * 1e3, "ratio": step / one})
    report = {
        "prompt": args.prompt,
        "new": args.new,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "model": "Llama-shaped, hidden 512, 4 layers, 8 q / 2 kv heads of 64, fp32",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=1)
    for row in rows:
        print(
            f"P={row['sp_size']}: {row['step_ms']:.2f} ms per decode step, {row['ratio']:.2f}x one process"
        )


if __name__ == "__main__":
    main()
