"""tailrl's own engine behind the Rollout protocol: `config` (the sections that configure it, and
opening it), `pool` (a step's rollout across workers, spot training of the drafter in the tail),
`worker` (one engine and its spot trainer), `runtimes` / `ray_runtime` (where workers run),
`spot` and `buffer` (drafter training and its data)."""
