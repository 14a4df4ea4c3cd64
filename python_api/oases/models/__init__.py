"""Models whose stacks run on the Oases schedules."""
from oases.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
