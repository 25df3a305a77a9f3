"""Rollout workers: sharded rollouts in local processes or Ray actors, spot training of the
drafter on idle workers, drafter versions (see tailrl.workers.pool)."""
