"""Config plumbing: flags from dataclass fields, TOML precedence, round trip, clear errors."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from tailrl import config as cfglib


@dataclass
class A:
    group_size: int = field(default=8, metadata={"help": "responses per prompt"})
    lr: float = 1e-6
    name: str | None = None
    fast: bool = True
    edges: tuple[int, ...] = (1, 2, 4)


@dataclass(frozen=True)
class B:
    temperature: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


SECTIONS = {"a": A, "b": B}


def _parse(argv):
    p = argparse.ArgumentParser()
    cfglib.add_arguments(p, SECTIONS)
    return p.parse_args(argv)


def test_defaults_toml_then_flags():
    toml = {"a": {"group_size": 4, "lr": 3, "edges": [1, 8]}, "b": {"temperature": 0.5}}
    c = cfglib.resolve(SECTIONS, _parse(["--group-size", "16", "--no-fast", "--name", "x", "--edges", "2,3"]), toml)
    assert c["a"] == A(group_size=16, lr=3.0, name="x", fast=False, edges=(2, 3))
    assert c["b"] == B(0.5)
    assert cfglib.resolve(SECTIONS) == {"a": A(), "b": B()}


def test_dump_round_trips(tmp_path):
    c = {"a": A(group_size=3, name='q"uote', edges=(5,)), "b": B(0.25)}
    path = tmp_path / "c.toml"
    path.write_text(cfglib.dump_toml(c))
    assert cfglib.resolve(SECTIONS, None, cfglib.read_toml(path)) == c


@pytest.mark.parametrize(
    "toml, argv, message",
    [
        ({"c": {}}, [], "unknown config section"),
        ({"a": {"groupsize": 3}}, [], "unknown key"),
        ({"a": {"group_size": "many"}}, [], "group_size: cannot read 'many' as int"),
        ({}, ["--lr", "fast"], "--lr: cannot read 'fast' as float"),
        ({}, ["--temperature", "-1"], r"\[b\]: temperature must be >= 0"),
    ],
)
def test_errors_name_the_culprit(toml, argv, message):
    with pytest.raises(cfglib.ConfigError, match=message):
        cfglib.resolve(SECTIONS, _parse(argv), toml)


def test_bad_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[a\n")
    with pytest.raises(cfglib.ConfigError, match="not valid TOML"):
        cfglib.read_toml(path)
    with pytest.raises(cfglib.ConfigError, match="cannot read config file"):
        cfglib.read_toml(tmp_path / "missing.toml")


def test_duplicate_field_names_rejected():
    @dataclass
    class C:
        lr: float = 0.1

    with pytest.raises(cfglib.ConfigError, match="both"):
        cfglib.add_arguments(argparse.ArgumentParser(), {"a": A, "c": C})


def test_renamed_fields_are_refused_with_the_new_name(capsys):
    @dataclass
    class Arm:
        draft_depth: int = 4

    @dataclass
    class Vllm:
        max_num_seqs: int = 64

    parser = argparse.ArgumentParser(prog="tailrl x")
    cfglib.add_arguments(parser, {"speculation": Arm})
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--num-steps", "3"])
    assert e.value.code == 2 and "--num-steps was renamed --draft-depth" in capsys.readouterr().err
    with pytest.raises(cfglib.ConfigError, match=r"^\[speculation\] num_steps was renamed draft_depth$"):
        cfglib.resolve({"speculation": Arm}, toml={"speculation": {"num_steps": 3}})
    with pytest.raises(cfglib.ConfigError, match=r"^config section \[spec\] was renamed \[speculation\]$"):
        cfglib.resolve({"speculation": Arm}, toml={"spec": {"draft_depth": 3}})
    # A setting that moved to a section both engines read: its old table names the new key.
    with pytest.raises(cfglib.ConfigError, match=r"^\[vllm\] num_speculative_tokens was renamed draft_depth$"):
        cfglib.resolve({"speculation": Arm, "vllm": Vllm}, toml={"vllm": {"num_speculative_tokens": 3}})
