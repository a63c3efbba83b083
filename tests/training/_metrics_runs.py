"""Worker bodies for the metrics tests: `evaluate()` with `compute_metrics` and `predict()` of a tiny random Llama
(fp32, no training), with `transformers.Trainer` ("hf", one process) or `UPipeTrainer` ("upipe").

Two metric set-ups per run: token accuracy from the argmax ids, and per-document perplexity from
`preprocess_logits_for_metrics` returning each position's log-probability of its target. The Trainer's function
gets unshifted labels and shifts them; UPipeTrainer's gets the targets aligned with the logits.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.training._runs import _dataset, _model, _packed


def token_accuracy(p) -> dict:
    """Accuracy of the argmax ids against the next token, over every target (labels shifted by one)."""
    preds, labels = p.predictions[:, :-1], p.label_ids[:, 1:]
    valid = labels != -100
    return {"accuracy": float((preds[valid] == labels[valid]).mean()), "targets": int(valid.sum())}


def document_log_probs(logp: np.ndarray, labels: np.ndarray) -> list[tuple[float, int]]:
    """(summed log-probability, targets) of every document: a document starts at each -100 label of a row (its
    first token under DataCollatorWithFlattening, or a padded row's first padding)."""
    docs = []
    for lp, lab in zip(logp, labels):
        doc = np.cumsum(lab == -100)  # [S]; position t's target lab[t+1] belongs to doc[t]
        valid = lab[1:] != -100  # [S-1]
        for d in np.unique(doc[:-1][valid]):
            sel = valid & (doc[:-1] == d)
            docs.append((float(lp[:-1][sel].sum()), int(sel.sum())))
    return docs


def perplexity(p) -> dict:
    docs = document_log_probs(p.predictions, p.label_ids)
    ppl = [float(np.exp(-s / n)) for s, n in docs]
    return {"docs": len(ppl), "ppl_mean": float(np.mean(ppl)), "ppl_max": float(np.max(ppl))}


def _shifted_log_probs(logits, labels):
    """transformers.Trainer's preprocess: logits [B, S, V], unshifted labels [B, S] -> [B, S] log p(label t+1)."""
    target = labels[:, 1:]
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = lp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (target != -100)
    return torch.cat([picked, picked.new_zeros(labels.shape[0], 1)], dim=1)


def _aligned_log_probs(logits, targets):
    """UPipeTrainer's preprocess: logits [B, T, V], aligned targets [B, T] -> [B, T] log p(target)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (targets != -100)


def _argmax(logits, labels):
    return logits.argmax(-1)


def _not_per_token(logits, targets):
    return logits.argmax(-1).sum()


def metrics_run(rank: int, world: int, spec: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_upipe

    args = TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_eval_batch_size=spec["batch"],
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    evals, collator = _dataset(9, 29, 96, seed=2), default_data_collator
    if spec.get("packed"):
        from transformers import DataCollatorWithFlattening

        evals, collator = _packed(evals), DataCollatorWithFlattening()
    out = {}
    upipe = spec["trainer"] == "upipe"
    setups = {
        # the Trainer's predictions are the full logits unless preprocessed; UPipeTrainer's are the argmax ids
        "accuracy": dict(compute_metrics=token_accuracy)
        if upipe
        else dict(compute_metrics=token_accuracy, preprocess_logits_for_metrics=_argmax),
        "ppl": dict(
            compute_metrics=perplexity,
            preprocess_logits_for_metrics=_aligned_log_probs if upipe else _shifted_log_probs,
        ),
    }
    if spec.get("bad"):
        setups = {
            "bad": dict(
                compute_metrics=token_accuracy, preprocess_logits_for_metrics=_not_per_token
            )
        }
    for name, extra in setups.items():
        kwargs = dict(
            model=_model(spec.get("lora", False), seed=11),
            args=args,
            eval_dataset=evals,
            data_collator=collator,
            **extra,
        )
        if upipe:
            hf_upipe.reset_sequence_parallel()
            cfg = hf_upipe.UPipeConfig(
                sp_size=spec["sp"],
                ring_size=spec.get("ring", 1),
                tiled_loss=spec.get("tiled", True),
                loss_chunk_tokens=7,
            )
            trainer = hf_upipe.UPipeTrainer(**kwargs, upipe_config=cfg)
        else:
            trainer = Trainer(**kwargs)
        try:
            metrics = trainer.evaluate()
        except ValueError as err:
            out[name] = f"{type(err).__name__}: {err}"
            continue
        pred = trainer.predict(evals)
        out[name] = {
            "metrics": metrics,
            "predict_metrics": pred.metrics,
            "predictions": pred.predictions,
            "label_ids": pred.label_ids,
            "mask": np.array(evals["attention_mask"])
            if "attention_mask" in evals.column_names
            else 1,
        }
    return out


def metrics_runs(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [metrics_run(rank, world, spec) for spec in specs]
