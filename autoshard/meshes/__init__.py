"""autoshard.meshes."""
