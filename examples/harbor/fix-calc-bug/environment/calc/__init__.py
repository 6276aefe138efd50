"""A tiny calculator package."""

from .ops import add, div, mul, sub

__all__ = ["add", "sub", "mul", "div"]
