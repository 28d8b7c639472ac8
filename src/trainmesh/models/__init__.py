"""Reference models."""
from .gpt import GPT, PRESETS, GPTConfig, gpt_plan, validate_gpt

__all__ = ["GPT", "GPTConfig", "PRESETS", "gpt_plan", "validate_gpt"]
