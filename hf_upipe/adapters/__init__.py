"""What ``hf_upipe.prepare_model`` installs on a model's modules, and the gate that admits a model under SP.

Modules, bottom to top:
- ``rope``: length-dependent RoPE from the global length; ``replaced``: forwards another library replaced
  (Liger, Hub kernels), verified per token or refused; ``shard_exchange``: what mixers exchange across shards;
  ``zero3``: whole weights under DeepSpeed ZeRO-3.
- ``delta_rule``, ``mixers``: hybrids' token mixers exact across shards (and the mixer classes verified);
  ``tiled_mlp``: MLPs and RMSNorms over sequence chunks, recomputed in backward.
- ``support``: the support gate, which models and calls run under SP; ``call_checks``: call arguments refused
  under SP for every model, and what a prepared model's latest call carried.
- ``hooks``: the two global forward hooks ``import hf_upipe`` installs: the guard against a model called on
  shards without hf_upipe, and one random stream per SP rank.

Imports nothing of ``hf_upipe.attention`` or above.
"""
