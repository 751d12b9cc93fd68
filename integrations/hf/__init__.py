"""mesh_cp adapter for hf (see the README's "Integrations" section)."""
