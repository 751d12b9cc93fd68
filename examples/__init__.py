"""Example programs of mesh_cp, run by path under their launchers (not installed with the package).

- ``examples/accelerate/finetune.py``: fine-tuning under ``accelerate launch``;
- ``examples/deepspeed/finetune.py``: fine-tuning with DeepSpeed (any ZeRO stage);
- ``examples/megatron/pretrain_gpt.py``: pretraining on megatron-core, on the installed step pieces
  ``mesh_cp.integrations.megatron.training``, with its CPU workarounds in ``examples/megatron/cpu_workarounds.py``;
- ``examples/common.py``: what they share (data, tokenizer, model, options, device binding, result line).

Each script puts the repository root on ``sys.path`` and imports its shared code as ``examples.common`` and
``examples.megatron.cpu_workarounds``, so it runs by path from any working directory. Each ends its output on rank
0 with one JSON line (``examples.common.print_result``).
"""
