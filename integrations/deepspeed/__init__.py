"""mesh_cp adapter for deepspeed (see the README's "Integrations" section)."""
