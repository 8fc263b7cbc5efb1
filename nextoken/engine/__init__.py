"""Request state and the generation loop (continuous batching comes in engine/engine.py)."""
