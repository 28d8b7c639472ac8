"""Typed configuration: the layout (ParallelConfig), the run (TrainConfig), and the one validation
of every field and layout rule. Imports core only.
"""
