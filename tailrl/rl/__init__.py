"""Reinforcement learning pieces that know nothing about how tokens are produced: tasks,
rewards, group advantages and the policy loss."""
