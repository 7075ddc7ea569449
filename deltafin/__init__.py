"""deltafin: run Kimi-family MoE models larger than RAM by streaming weights from disk."""
from .api import Model, load

__all__ = ["load", "Model"]
__version__ = "0.1.0"
