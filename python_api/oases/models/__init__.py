"""Models whose stacks run on the Oases schedules: our GPT, Hugging Face decoders (HFStack) and
nanoGPT-style models (NanoGPTStack), each an oases.schedule.Stack."""

from oases.models.gpt import GPT, GPTConfig
from oases.models.hf import HFStack
from oases.models.nanogpt import NanoGPTStack

__all__ = ["GPT", "GPTConfig", "HFStack", "NanoGPTStack"]
