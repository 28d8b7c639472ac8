"""The Engine: composes mesh, parallel strategies and executor into a training step; precision,
recompute, compile, sharded initialisation. Imports every building block, never run/ or cli/.
"""
