"""Training under sequence parallelism: the run's runtime and its two faces, the Trainer and the plugin.

Modules, bottom to top:
- ``loss``: the tiled loss of a model's shard; ``predictions``: per-token predictions of a shard for metrics;
  ``loaders``: accelerate loaders under SP; ``parallelism``: accelerate's ``ParallelismConfig``;
  ``liger``: Liger applied before ``prepare_model``; ``model_offload``: FSDP2's host offload of the model's
  state; ``offload``: the checkpointed layer inputs offloaded to host or disk; ``checkpoint``: checkpoint
  manifests; ``checkpoint_layout``: the layout recorded in a checkpoint, checked on resume;
  ``auto_settings``: ``UPipeConfig(auto=True)``, the planner's choice applied; ``oom``: an
  out-of-memory error explained with the planner's answer; ``oom_advisor``: that answer computed by a process
  that outlives the rank (a launcher's stop); ``save_errors``: a failed checkpoint write explained;
  ``peers``: the heartbeat that names a rank that stopped, and the step's guard.
- ``runtime``: ``UPipeRuntime``, setup checks, loss and exact evaluation of one run.
- ``trainer``: ``UPipeTrainer``; ``plugin``: ``UPipePlugin``, both on the runtime (``hf_upipe.trl`` builds on
  the trainer).
"""
