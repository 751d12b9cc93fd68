"""mesh_cp with ``accelerate launch``: the long-context fine-tuning example.

The example (``integrations/accelerate/finetune.py``, module ``mesh_cp.integrations.accelerate.finetune``)
is started by ``accelerate launch``; accelerate starts the processes and the gloo/NCCL group and does
mixed precision, and mesh_cp adds the DP x CP layout (:class:`mesh_cp.integrations.hf.DataContextParallel`),
the ``mesh_cp`` attention and the sharded batches. accelerate's own ``ParallelismConfig`` only knows
its torch context parallelism (``cp_backend="torch"``, CUDA only), so it is not used. Its data, model and
command-line options are shared with the DeepSpeed example (:mod:`mesh_cp.integrations.examples`).
"""
