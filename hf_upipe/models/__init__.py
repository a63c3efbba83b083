"""What hf_upipe knows of transformers models, changing none of them (layer: above ``hf_upipe.ops``).

Modules:
- ``architectures``: the registry keyed by ``model_type`` (fused adapters, geometry of a config);
  ``families``: its entries, family by family; ``verification``: adapters verified by what they compute
  (fingerprints of verified releases, behaviour on a tiny model); ``probe``: the tiny models it runs.
- ``peft``: the base model of a PEFT model, without importing peft.
- ``presets``: the model names every command understands (presets, tiny test models, Hub ids).
"""
