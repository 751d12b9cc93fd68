"""mesh_cp adapter for accelerate (see the README's "Integrations" section)."""
