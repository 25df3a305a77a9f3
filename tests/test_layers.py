"""tailrl's layering (scripts/check_layers.py): no module imports a layer above its own and no
imports run in a loop; and the check finds both where they are. The module-size check
(scripts/check_sizes.py) names what is over its budget."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_layers.py"
spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
check_layers = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(check_layers)


def test_tailrl_imports_only_down_and_in_no_loop(capsys):
    assert check_layers.main([]) == 0, capsys.readouterr().out


def test_an_upward_import_and_loops_are_found(tmp_path, monkeypatch):
    # A loop closed by imports inside functions is found as well: the registry's lookup of an
    # engine's config, which imports the registry back, is one.
    files = {
        "engine.py": "from tailrl.rollout.protocol import Request\n",
        "rollout/protocol.py": "",
        "rollout/registry.py": "def engine():\n    from tailrl.rollout.native import config\n",
        "rollout/native/config.py": "from tailrl.rollout.registry import engine\n",
        "rollout/vllm/config.py": "def open():\n    from tailrl.rollout.vllm.rollout import VllmRollout\n",
        "rollout/vllm/rollout.py": "from tailrl.rollout.vllm.config import open\n",
        "rl/a.py": "from tailrl.rl import b\n",
        "rl/b.py": "import tailrl.rl.a\n",
    }
    for name, text in files.items():
        (tmp_path / "tailrl" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tailrl" / name).write_text(text)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    assert check_layers.violations(check_layers.modules()) == [
        "upward (top-level): tailrl.engine [engine] imports tailrl.rollout.protocol [seam]",
        "cycle (top-level): tailrl.rl.a, tailrl.rl.b",
        "cycle (through function-level imports): tailrl.rollout.native.config, tailrl.rollout.registry",
        "cycle (through function-level imports): tailrl.rollout.vllm.config, tailrl.rollout.vllm.rollout",
    ]


def test_the_size_check_names_each_module_over_its_budget(tmp_path):
    spec = importlib.util.spec_from_file_location("check_sizes", SCRIPT.parent / "check_sizes.py")
    check_sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_sizes)
    for name, lines in {"tailrl/a.py": 500, "tailrl/x/b.py": 501,
                        "tests/test_c.py": 600, "tests/test_d.py": 601}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n" * lines)
    assert check_sizes.over_budget(tmp_path) == ["tests/test_d.py: 601 lines, over the tests/ budget of 600",
                                                 "tailrl/x/b.py: 501 lines, over the tailrl/ budget of 500"]
