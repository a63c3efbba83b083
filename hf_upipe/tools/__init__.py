"""The commands' machinery above the library: self-test, architecture matrix, adapter status.

Modules:
- ``selftest``: ``hf-upipe selftest`` (its flags, table and exit codes too); ``selftest_size``: what it builds;
  ``vlm_check``: a vision-language model under SP against one process; ``testing``: spawned process groups.
- ``matrix``, ``vlm_matrix``: the architecture matrix and its vision-language rows.
- ``adapter_status``: every adapter's verdict on the installed transformers (``hf-upipe env``).
"""
