"""The package version, importable from anywhere without importing the face."""
__version__ = "0.1.0"
