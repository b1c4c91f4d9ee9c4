"""specstack: lossless speculative decoding engine."""
from specstack.errors import SpecstackError

__all__ = ["SpecstackError"]
__version__ = "0.1.0"
