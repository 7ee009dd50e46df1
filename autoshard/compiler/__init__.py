"""autoshard.compiler."""
