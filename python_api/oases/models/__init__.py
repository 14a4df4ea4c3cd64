"""Models whose stacks run on the Oases schedules: our GPT, and Hugging Face decoders through HFStack."""
from oases.models.gpt import GPT, GPTConfig
from oases.models.hf import HFStack

__all__ = ["GPT", "GPTConfig", "HFStack"]
