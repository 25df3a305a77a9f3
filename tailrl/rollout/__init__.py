"""Rollouts behind one seam: `protocol` (all the RL loop knows of generation) and each engine
behind it, side by side: `native` (tailrl's own engine and its workers) and `vllm` (an
in-process vLLM engine)."""
