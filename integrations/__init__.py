"""Framework adapters, installed as ``mesh_cp.integrations.<framework>``.

Each adapter uses only the public API of :mod:`mesh_cp` and its own framework; adapters never
import each other. What two adapters share lives here: :func:`switch_attention` (a model's attention
run over a mesh, whichever adapter built the model) and :func:`ds_attention_shape` (the shape that a
DeepSpeed config's ``"tile": "auto"`` predicts for, read by the DeepSpeed adapter and by the Hugging
Face ``Trainer`` given a DeepSpeed config).

accelerate needs no adapter of its own: ``accelerate launch`` starts the processes and the process group and
does mixed precision, and the public API of :mod:`mesh_cp` with the Hugging Face adapter does the rest
(``examples/accelerate/finetune.py``); the Hugging Face adapter reads the CP sizes of an accelerate config file's
``parallelism_config`` block (``hf.parallel_from_accelerate``). The example programs live in ``examples/``, not in this package.
"""

from __future__ import annotations

from typing import Any

from mesh_cp.integrations.layout import ds_attention_shape, is_hf_model, parallel_from_config


def switch_attention(model: Any, mesh: Any, **options: Any) -> None:
    """Run ``model``'s attention over ``mesh`` with ``options`` (``schedule``, ``backward``) of
    :func:`mesh_cp.mesh_attn_func`: a Hugging Face model through ``attn_implementation="mesh_cp"``
    (:func:`mesh_cp.integrations.hf.attach`), any other through its modules that have a ``use_mesh``
    method (such as :class:`mesh_cp.integrations.deepspeed.MeshDistributedAttention`)."""
    if is_hf_model(model):
        from mesh_cp.integrations.hf import attach

        attach(model, mesh, **options)
        return
    modules = [m for m in model.modules() if callable(getattr(m, "use_mesh", None))]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} is neither a Hugging Face model nor has MeshDistributedAttention modules: "
            f"compute its attention with mesh_cp.integrations.deepspeed.MeshDistributedAttention"
        )
    for m in modules:
        m.use_mesh(mesh, **options)


__all__ = ["ds_attention_shape", "parallel_from_config", "switch_attention"]
