"""autoshard.passes."""
