"""TLT for TRL's GRPOTrainer users (tailrl.trl.trainer; docs/trl.md). Needs TRL and vLLM:
pip install 'tailrl[trl]'."""

from tailrl.trl.generation import TLTConfig
from tailrl.trl.trainer import TLTGRPOTrainer

__all__ = ["TLTConfig", "TLTGRPOTrainer"]
