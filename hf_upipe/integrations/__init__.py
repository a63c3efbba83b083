"""Translation between Hugging Face objects and ``hf_upipe.ops``.

``transformers.register`` (run by ``import hf_upipe``) makes ``attn_implementation="upipe"`` available.
"""
