"""TLT inside TRL's GRPOTrainer with a LoRA-wrapped policy (tailrl.trl.lora): the engine decodes
the merged weights, and the drafter trains on the hidden states of the model under the adapter.

One one-step run on the tiny model, drafter and configs, the policy wrapped in LoRA on
every linear layer of the decoder with random B factors (PEFT starts them at zero, where merged
and unmerged weights are the same), so the adapter changes the model's greedy tokens from the
first sync on; the step's optimizer step moves the adapters again. After a sync, the engine's
greedy tokens must be the PEFT model's own (its unmerged forward, fp32); each hidden state the
trainer's loss forwards hand to the drafter must be the base model's final norm's output under
the adapter for that sequence alone (to fp32 rounding: the loss forward pads the batch); the base
weights must be bit for bit what they were (the sync merges into new tensors).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")
pytest.importorskip("peft")

from conftest import tiny_trl_run, trl_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("trl_process")

NEW = 24  # greedy tokens per prompt


def lora_policy(hf):
    """`hf` under LoRA (rank 8) on every linear layer of its decoder, the B factors random."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def greedy(model, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]


def check_observed_hidden(gen, model, checked: list[int]) -> None:
    """Each sequence the trainer hands the drafter is checked, as it is handed over (the adapters
    as the loss forward saw them), against the base model's own forward of that sequence alone."""
    own = gen.observe
    final = model.get_base_model().model  # the decoder and its final norm, LoRA's layers inside

    def observe(forwards):
        with torch.no_grad():
            for f in forwards:
                ref = final(input_ids=f.tokens[None]).last_hidden_state[0, :-1]
                torch.testing.assert_close(f.hidden, ref, rtol=1e-5, atol=1e-5)
                with model.disable_adapter():  # the check can tell the adapter's states from the base's
                    assert not torch.allclose(f.hidden, final(input_ids=f.tokens[None]).last_hidden_state[0, :-1],
                                              rtol=1e-3, atol=1e-3)
                checked.append(f.tokens.shape[0])
        own(forwards)

    gen.observe = observe


def test_a_lora_policy_syncs_merged_and_its_hidden_states_train_the_drafter(tmp_path):
    from vllm import SamplingParams as VllmSampling
    from vllm.inputs import TokensPrompt

    from tailrl.trl import TLTGRPOTrainer

    kwargs = tiny_trl_run(tmp_path, max_steps=1)
    model = lora_policy(kwargs["model"])
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    # Eager: vLLM's compile at start would be most of the test's time, and the weights are what it checks.
    tlt = dataclasses.replace(kwargs["tlt"], enforce_eager=True)
    trainer = TLTGRPOTrainer(**{**kwargs, "model": model, "tlt": tlt})
    gen, checked = trainer.vllm_generation, []
    check_observed_hidden(gen, model, checked)
    prompts = trl_prompts(16)
    try:
        trainer.train()
        gen.sync_weights()  # the adapters the optimizer step left
        gen.steps.begin()
        engine = gen.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                  VllmSampling(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    finally:
        gen.close()
    # Both loss forwards of the step (two micro-batches of four) reached the drafter, checked.
    assert len(checked) == 8
    assert any(not torch.equal(p, lora[n]) for n, p in model.named_parameters() if ".lora_B." in n)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if ".lora_" not in n)
    own = greedy(model, prompts)
    with model.disable_adapter():
        unadapted = greedy(model, prompts)
    assert [list(o.outputs[0].token_ids) for o in engine] == own
    assert own != unadapted  # the adapter changes the greedy tokens: base weights in the engine would fail
