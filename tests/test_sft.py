"""Cold start (tailrl.rl.sft): the packed, prompt-masked loss equals a per-example reference,
the output is a model directory transformers loads with tailrl's logits, and the cache and
Ctrl-C behave."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tailrl.loading import load_model, load_tokenizer
from tailrl.rl.sft import (
    SFT_FILE,
    SFTConfig,
    SFTProgress,
    cache_key,
    cached,
    example,
    lr_at,
    nll_sums,
    sft,
    worked_task,
)

TASK = "sums(max_terms=3, max_value=9)"


def tiny_config(model_dir, **overrides):
    kw = dict(model=str(model_dir), task=TASK, steps=2, batch_size=3, micro_batch=2, lr=1e-2, autocast="fp32",
              eval_problems=2, eval_max_new_tokens=4)
    kw.update(overrides)
    return SFTConfig(**kw)


def test_packed_loss_equals_per_example_transformers_reference(char_model_dir):
    """nll_sums packs examples (prompt + solution each) into rows; the reference scores every
    example alone with transformers and sums -log p over the solution tokens only."""
    from transformers import AutoModelForCausalLM

    task, tok = worked_task(TASK), load_tokenizer(char_model_dir)
    samples = [example(task, tok, task.sample(0, i), tok.eos_token_id) for i in range(5)]
    ours = nll_sums(load_model(char_model_dir, "fp32"), samples, 2, torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(char_model_dir, dtype=torch.float32).eval()
    ref = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.token_ids)])
            logp = torch.log_softmax(ref_model(ids).logits[0, :-1].double(), -1)  # (T-1, V)
            n = len(s.prompt_ids)
            ref -= sum(float(logp[n - 1 + j, t]) for j, t in enumerate(s.token_ids))
    assert math.isclose(ours, ref, rel_tol=1e-5)


def test_lr_schedule_hand_computed():
    cfg = SFTConfig(steps=10, warmup=0.2, lr=1.0, min_lr=0.1)
    assert [lr_at(s, cfg) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert math.isclose(lr_at(9, cfg), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_output_loads_in_transformers_with_tailrl_logits_and_is_cached(char_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(char_model_dir)
    result = sft(cfg)
    out = result.out_dir
    assert out == tmp_path / "cache" / "sft" / cache_key(cfg, char_model_dir)
    assert not result.cached and result.steps == 2 and not result.interrupted
    assert set(result.evals[-1].accuracy) == {"greedy", "T=1"}
    base, tuned = load_file(char_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert not torch.equal(base["model.embed_tokens.weight"], tuned["model.embed_tokens.weight"])  # it trained
    assert load_tokenizer(out).chat_template == load_tokenizer(char_model_dir).chat_template
    # fp32 on both sides; the kernels differ (our attention and RMSNorm vs transformers'), so
    # equality is to rounding: 1e-4 absolute on logits of magnitude ~1.
    ids = torch.tensor([list(range(3, 40))])
    ours = load_model(out, "fp32")(ids, torch.arange(ids.shape[1])[None])
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)
    again = sft(cfg)  # same inputs: the cached directory, nothing trained
    assert again.cached and again.out_dir == out and again.steps == 2
    other = sft(tiny_config(char_model_dir, lr=2e-2))  # a setting that shapes the weights: a new entry
    assert not other.cached and other.out_dir != out


def test_ctrl_c_saves_and_is_not_reused(char_model_dir, tmp_path):
    cfg = tiny_config(char_model_dir, steps=3)

    def interrupt(event):
        if isinstance(event, SFTProgress) and event.step == 1:
            raise KeyboardInterrupt

    result = sft(cfg, tmp_path / "out", on_event=interrupt)
    assert result.interrupted and result.steps == 1
    meta = json.loads((tmp_path / "out" / SFT_FILE).read_text())
    assert meta["interrupted"] and meta["steps"] == 1
    load_model(tmp_path / "out", "fp32")  # a complete model directory
    assert not cached(tmp_path / "out", cache_key(cfg, char_model_dir))
    rerun = sft(cfg, tmp_path / "out")
    assert not rerun.cached and rerun.steps == 3 and not rerun.interrupted


def test_task_without_solutions_is_refused(char_model_dir):
    with pytest.raises(ValueError, match="no worked solutions"):
        sft(tiny_config(char_model_dir, task="rg:chain_sum(max_terms=2, max_digits=1)"))


def test_cli_writes_then_reuses(char_model_dir, tmp_path, capsys):
    from tailrl.cli import main

    argv = ["sft", "--model", str(char_model_dir), "--task", TASK, "--steps", "1", "--batch-size", "2",
            "--autocast", "fp32", "--eval-problems", "1", "--eval-max-new-tokens", "2", "--out", str(tmp_path / "m")]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert first.out.strip() == str(tmp_path / "m") and "sft eval at step 1" in first.err
    assert main(argv) == 0
    assert "reusing the cold start" in capsys.readouterr().err
    assert main(["sft", "--model", str(char_model_dir), "--task", "rg:chain_sum", "--out", str(tmp_path / "x")]) == 2


def test_warmup_solution_sequences_are_the_solutions_with_the_targets_hidden_states(char_model_dir):
    """The drafter warm-up's extra data: prompt + worked solution + end of turn, for problems
    after the sampled prompts, each with the target's hidden state at every position but the last."""
    from tailrl.warmup import WarmupConfig, solution_data

    cfg = WarmupConfig(model=str(char_model_dir), task=TASK, num_prompts=3, holdout_prompts=1, solutions=2)
    target, tok, task = load_model(char_model_dir, "fp32"), load_tokenizer(char_model_dir), worked_task(TASK)
    seqs = solution_data(target, tok, cfg)
    assert len(seqs) == 2
    for j, s in enumerate(seqs):
        problem = task.sample(0, 3 + j)  # seed 0, after the 3 sampled prompts
        ref = example(task, tok, problem, tok.convert_tokens_to_ids(tok.eos_token))
        assert s.tokens.tolist() == [*ref.prompt_ids, *ref.token_ids] and s.prompt_len == len(ref.prompt_ids)
        assert tok.decode(ref.token_ids[:-1]) == task.solution(problem)
        with torch.no_grad():
            h = target.hidden(s.tokens[None], torch.arange(len(s.tokens))[None])[0]
        torch.testing.assert_close(s.hidden, h[:-1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="prompts file"):
        WarmupConfig(prompts="p.jsonl", solutions=4)
