"""Translation between Hugging Face objects and ``hf_upipe.ops`` (no math of its own).

Modules:
- ``transformers``: the registered ``attn_implementation="upipe"`` (imported once transformers' modeling code
  loads: ``hf_upipe.registration``); ``sp_mask``: its mask function; ``sp_kernels``: the kernel of one call
  (documents, window, chunks, soft-capping, ring); ``sp_checks``: the SP state of the attention paths and the
  checks of a model and a call that need no communication.
- ``prepare``: ``prepare_model`` / ``unprepare_model`` over the registry of ``hf_upipe.architectures``.
- ``fused``: the fused attention block installed on (and removed from) attention modules; ``fused_call``: the
  forward it installs; ``fused_weights``: what the block reads off a module, and why a module keeps the registered
  path; ``fused_checks``: whether the block is verified on the installed transformers.
- ``support``: the support gate, which models and calls run under SP; ``call_checks``: call arguments refused
  under SP for every model; ``guard``: refuses a model called on shards without hf_upipe; ``attention_tables``:
  models with their own table of attention classes refuse "upipe" by name; ``replaced``: forwards another library
  replaced (Liger, Hub kernels), verified per token or refused; ``liger``: Liger applied before ``prepare_model``.
- ``randomness``: a random stream per SP rank in a training forward.
- ``layout``: the layout check, do the ranks of an SP group hold shards of the same batch; ``layout_rows``: the
  per-row facts of a shard it reads and padding across ranks; ``model_calls``: what
  a prepared model's latest call carried, for attention layers that do not receive it.
- ``chunked``: sliding-window and chunked masks under SP; ``mask_probe``: probes of a model's mask
  function against causal masking; ``rope``: length-dependent RoPE from the global
  length; ``ring_seam``: the ring kernel an attention call runs.
- ``mixers``, ``delta_rule``, ``shard_exchange``, ``mixer_sources``: hybrids' token mixers across shards, and the
  mixer classes verified.
- ``adapter_status``: every adapter's verdict on the installed transformers; ``probe``: the tiny models the
  verification runs.
- ``loss``: the tiled loss of a model's shard; ``predictions``: per-token predictions of a shard for metrics;
  ``loaders``: accelerate loaders under SP; ``parallelism``: accelerate's ``ParallelismConfig``; ``peft``: the
  base model of a PEFT model; ``zero3``: whole weights under DeepSpeed ZeRO-3 for the fused block, the tiled MLP
  and the tiled loss; ``model_offload``: FSDP2's host offload of the model's state (``model_offload='cpu'``).
- ``accelerate``: re-exports ``UPipePlugin`` for older imports; it lives in ``hf_upipe.plugin`` (layer 3, beside
  the trainer: both build on ``UPipeRuntime``).
"""
