"""Model stages and their engines, and model preparation (bundled weights, conversion)."""
