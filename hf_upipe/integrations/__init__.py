"""Translation between Hugging Face objects and ``hf_upipe.ops`` (no math of its own).

``transformers`` (the registered ``attn_implementation="upipe"`` and its mask function, imported once
transformers' modeling code loads: ``hf_upipe.registration``), ``prepare`` (``prepare_model`` /
``unprepare_model`` over the registry of ``hf_upipe.architectures``), ``fused`` (the fused attention block on a
module), ``loss`` (the tiled loss of a model's shard), ``loaders`` (accelerate loaders under SP), ``peft`` (the base
model of a PEFT model), ``accelerate`` (``UPipePlugin``).
"""
