"""`tailrl bench peers`: the message without TRL, config checks, and (when TRL is installed) both
sides on a tiny random model with SmolLM2's tokenizer."""

import json
import shutil
import sys

import pytest

from conftest import build_hf

from tailrl.bench.peers import NO_TRL, BenchPeersConfig
from tailrl.bench.suite import _peers
from tailrl.cli import main


def test_without_trl_the_bench_says_how_to_install_it_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    assert main(["bench", "peers", "--json"]) == 2
    assert NO_TRL in capsys.readouterr().err


def test_micro_batch_must_divide_the_generation_batch():
    with pytest.raises(ValueError, match="must divide"):
        BenchPeersConfig(num_prompts=3, group_size=2, micro_batch=4)


@pytest.fixture(scope="module")
def tiny_chat_dir(smollm2_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    path = tmp_path_factory.mktemp("tiny-chat")
    build_hf("llama", seed=2, vocab_size=49152, eos_token_id=2, bos_token_id=1, pad_token_id=2,
             tie_word_embeddings=False).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


def test_trl_tokenizes_prompts_as_tailrl_does(smollm2_dir):
    from tailrl.loading import load_tokenizer
    from tailrl.rl.tasks import encode_question, format_prompt

    tok = load_tokenizer(smollm2_dir)
    question = "What is 3 + 4?"
    # TRL's _tokenize_prompts: the chat template applied with tokenize=True.
    trl_ids = tok.apply_chat_template(format_prompt(question), add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
    assert list(trl_ids) == list(encode_question(tok, question))


@pytest.mark.slow  # both trainers and four batch-1 runs: ~20 s, and the default selection's budget is spent
def test_both_sides_run_the_same_steps_and_batch1(tiny_chat_dir, capsys):
    pytest.importorskip("trl")
    code = main(["bench", "peers", "--model", str(tiny_chat_dir), "--num-prompts", "2", "--group-size", "2",
                 "--max-new-tokens", "4", "--steps", "2", "--warmup", "0", "--micro-batch", "2", "--lookup", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)  # stdout holds only the JSON object
    for side in ("tailrl", "trl"):
        r = result[side]
        assert len(r["steps"]) == 2
        assert 0 < r["tokens_generated"] <= 2 * 2 * 2 * 4
        assert all(s["rollout_s"] > 0 and s["train_s"] >= 0 for s in r["steps"])
        assert r["threads_after"] == 1
    assert result["speedup_step"] == pytest.approx(result["trl"]["step_s"] / result["tailrl"]["step_s"])
    assert result["config"]["spec"] == "auto"
    b = result["batch1"]
    for side, arms in (("tailrl", ("plain", "ngram")), ("transformers", ("plain", "lookup"))):
        assert all(0 < b[side][a]["tokens"] <= 2 * 4 and b[side][a]["tok_s"] > 0 for a in arms)
    rows = [line for line in _peers(result) if line.startswith("| TRL") or line.startswith("| tailrl")]
    assert len(rows) == 2  # the results page's rendering of the report
