"""``attn_implementation="upipe"`` inside transformers: the registered function and the fused block.

Modules, bottom to top:
- ``state``: the SP state of the attention paths, and the checks of a model and a call that need no
  communication; ``mask``: the mask function registered with "upipe", local (window, chunk) patterns and mask
  probes; ``layout``: the layout check, do the ranks of an SP group hold shards of the same batch;
  ``kernel``: the kernel of one call (documents, window, chunks, soft-capping, ring); ``call``: the call
  prelude both paths run first (refusals, documents, layout, kernel), what a path does not implement passed as
  an argument.
- ``registered``: the registered attention function (``upipe_attention_forward``), models with their own table of
  attention classes; ``fused``: the fused attention block installed on attention modules (what it reads, the
  forward it installs, whether it is verified).
- ``registration``: ``"upipe"`` registered with transformers as soon as its modeling code loads, importing no
  transformers itself (``import hf_upipe`` runs it).

Imports ``hf_upipe.adapters`` and below, never ``hf_upipe.prepare`` or above.
"""
