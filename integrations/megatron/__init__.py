"""mesh_cp adapter for megatron (see the README's "Integrations" section)."""
