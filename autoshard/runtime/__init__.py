"""autoshard.runtime."""
