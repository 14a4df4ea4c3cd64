"""Oases under other libraries' training loops, each imported on demand (the core never imports them).

from oases.integrations.transformers import OasesTrainer   # transformers' Trainer on TP x DP (needs accelerate)
"""
