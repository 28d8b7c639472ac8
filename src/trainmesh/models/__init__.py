"""Reference models.

Imports core and observe: models know no parallelism (their plans and hints are data).
"""
from .gpt import GPT, PRESETS, GPTConfig, gpt_plan, validate_gpt

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt_plan", "validate_gpt"]
