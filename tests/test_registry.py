"""The engine registry (tailrl.rollout.registry): engines by name, each reading its own sections;
a section only the engine not chosen reads, set away from its defaults, is refused in one line
by `tailrl generate` as by `tailrl train` (test_pipeline.py); the loop names the engines without
importing any."""

import subprocess
import sys
from pathlib import Path

import pytest

from tailrl.cli import main
from tailrl.pipeline import TRAIN_SECTIONS
from tailrl.rollout import registry


def test_names_and_sections():
    assert registry.NAMES == ("native", "vllm") and registry.DEFAULT == "native"
    for name in registry.NAMES:
        entry = registry.engine(name)
        assert entry.name == name and all(TRAIN_SECTIONS[s] is cls for s, cls in entry.sections.items())
    assert set(TRAIN_SECTIONS) == {"train", "grpo", *registry.train_sections()}
    with pytest.raises(ValueError, match="engine must be one of native, vllm, got 'nosuch'"):
        registry.engine("nosuch")


@pytest.mark.parametrize("flags,message", [
    (["--kv-cache-gb", "1"], "[vllm] configures the vllm engine, but this run's is --engine native: leave [vllm] at "
                             "its defaults or use --engine vllm"),
    (["--engine", "vllm", "--max-batch", "4"], "[engine] configures the native engine"),
])
def test_generate_refuses_what_its_engine_does_not_read(capsys, flags, message):
    assert main(["generate", "--prompt", "ab", *flags]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.startswith("tailrl: error: ") and message in err and err.count("\n") == 1


def test_the_loop_names_the_engines_without_importing_them():
    code = ("import sys, tailrl.rl.train; "
            "assert not [m for m in sys.modules if m.startswith(('tailrl.rollout.native', 'tailrl.rollout.vllm', "
            "'vllm'))]")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], check=True)
