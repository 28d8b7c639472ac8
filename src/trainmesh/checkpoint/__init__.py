"""Sharded checkpoints through a logical-tensor manifest, resume checks, the save-dir lock,
export. Imports core, config, comm and the parallel building blocks, never the engine.
"""
