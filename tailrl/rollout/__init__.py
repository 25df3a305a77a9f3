"""Rollouts behind one seam: `protocol` (what the RL loop knows), `native` (tailrl's own engine)."""
