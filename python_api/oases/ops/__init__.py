"""Fused ops."""
