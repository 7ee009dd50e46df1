"""autoshard: an automatic parallelization compiler for JAX train steps."""
__version__ = "0.1.0"
