"""Training recipes for drafters (written against Accelerate)."""
