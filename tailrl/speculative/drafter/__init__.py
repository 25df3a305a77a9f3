"""The learned drafter: the model (model), its training step and data packing (training), offline
warm-up (warmup) and export for serving engines (export)."""
