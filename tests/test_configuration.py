"""Every flag of every command set three ways (flag, TRACETRAIN_<FLAG>, serve's --config file) with one
precedence; ``serve --print-config`` reads back as the same configuration, secrets masked; renamed variables
keep working with a warning."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tracetrain_cli._config import apply
from tracetrain_cli._main import build_parser, main
from tracetrain_cli._setting_flags import settings_from
from tracetrain_core import apply_sources, env_name, flag_actions, long_flag, subcommand_chain
from tracetrain_demo.run import parser as demo_parser

KEY = "an-inference-key-" + "k" * 20
TOKEN = "the-admin-token-" + "t" * 20
PASSWORD = "db-pass-" + "p" * 12

# Values a flag may take, tried in order until its parser accepts one (choices come first).
_CANDIDATES = ("3", "0.5", "tensorboard", "0,1", "agent", "external", "x=y", "/tmp/somewhere")


def commands() -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """Every command (its words) and its parser: tracetrain's sub-commands, nested ones too, and the demo."""
    def walk(words: list[str], parser: argparse.ArgumentParser) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if words:
            yield words, parser
        for sub in subs:
            for name, child in sub.choices.items():
                if name != "demo":
                    yield from walk([*words, name], child)

    yield from walk([], build_parser())
    yield ["demo"], demo_parser()


def _value_for(action: argparse.Action, parser: argparse.ArgumentParser) -> str | None:
    if action.nargs == 0:
        return None
    candidates = [str(c) for c in action.choices][-1:] if action.choices else list(_CANDIDATES)
    for text in candidates:
        try:
            parser.parse_known_args([long_flag(action), text])
        except SystemExit:
            continue
        return text
    raise AssertionError(f"no value found for {long_flag(action)}")


def test_every_flag_of_every_command_is_set_through_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    walked = 0
    for words, _ in commands():
        parser = _fresh(words)
        for action in flag_actions(parser):
            flag = long_flag(action)
            text = _value_for(action, parser)
            on_command_line = [flag] if text is None else [flag, text]
            want = getattr(_fresh(words).parse_known_args(on_command_line)[0], action.dest)
            env = {env_name(flag): "true" if text is None else text}
            parser_from_env = _fresh(words)
            origins = apply_sources(parser_from_env, [], env)
            got = getattr(parser_from_env.parse_known_args([])[0], action.dest)
            assert got == want, (words, flag, env)
            assert origins[action.dest] == f"env {env_name(flag)}", (words, flag)
            walked += 1
    capsys.readouterr()
    assert walked > 100  # serve's ~80 flags, the others', the demo's


def _fresh(words: list[str]) -> argparse.ArgumentParser:
    """A new parser of the command; its required flags optional, so that each flag is parsed alone."""
    parser = demo_parser() if words == ["demo"] else {tuple(w): p for w, p in commands()}[tuple(words)]
    for action in parser._actions:
        action.required = False
    for group in parser._mutually_exclusive_groups:
        group.required = False
    return parser


def test_a_switch_takes_true_or_false_and_a_repeatable_flag_a_list() -> None:
    serve = _fresh(["serve"])
    apply_sources(serve, [], {"TRACETRAIN_REGRESSION_GUARD": "false", "TRACETRAIN_UPSTREAM": "http://a/v1,http://b/v1",
                              "TRACETRAIN_NO_TRAIN": "true"})  # fmt: skip
    args = serve.parse_args([])
    assert args.regression_guard is False and args.no_train is True
    assert settings_from(args).upstreams == ("http://a/v1", "http://b/v1")
    serve = _fresh(["serve"])
    with pytest.raises(ValueError, match=r"TRACETRAIN_NO_TRAIN.*true or false"):
        apply_sources(serve, [], {"TRACETRAIN_NO_TRAIN": "maybe"})


def _print_config(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(["serve", "--print-config", *argv]) == 0
    return capsys.readouterr().out


def _settings(*argv: str) -> Any:
    parser = build_parser()
    apply(parser, ["serve", *argv], os.environ)
    return settings_from(parser.parse_args(["serve", *argv]))


def test_a_flag_wins_over_the_environment_which_wins_over_the_file_which_wins_over_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tracetrain.toml"
    config.write_text("header-timeout = 11\nbody-timeout = 31\ngroup_size = 5\n")
    monkeypatch.setenv("TRACETRAIN_HEADER_TIMEOUT", "12")
    monkeypatch.setenv("TRACETRAIN_BODY_TIMEOUT", "32")
    given = ("--config", str(config), "--header-timeout", "13")
    settings = _settings(*given)
    assert (settings.header_timeout_s, settings.body_timeout_s, settings.group_size) == (13, 32, 5)
    assert _settings("--config", str(config)).header_timeout_s == 12
    monkeypatch.delenv("TRACETRAIN_HEADER_TIMEOUT")
    assert _settings("--config", str(config)).header_timeout_s == 11
    assert _settings().header_timeout_s == 15

    monkeypatch.setenv("TRACETRAIN_CONFIG", str(config))  # the file named by its variable, as every flag
    assert _settings().header_timeout_s == 11
    monkeypatch.delenv("TRACETRAIN_CONFIG")

    printed = _print_config(capsys, *given)
    assert "header-timeout = 13.0  # flag" in printed
    assert "body-timeout = 32.0  # env TRACETRAIN_BODY_TIMEOUT" in printed
    assert "group-size = 5  # file" in printed
    assert "# seat-timeout = 900.0  # default" in printed


def test_print_config_reads_back_as_the_same_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rubric.md").write_text("Shorter SQL wins.")
    config = tmp_path / "first.toml"
    config.write_text(
        'reward-source = "both"\npolicy = ["support", "sql"]\nreward-weights = { correct = 1.0, format = 0.25 }\n'
        '[policies.sql]\ngroup-size = 4\njudge-rubric = "@rubric.md"\nsampling = { temperature = 0.7 }\n'
    )
    monkeypatch.setenv("TRACETRAIN_CANARY", "0.2")
    monkeypatch.setenv("TRACETRAIN_JUDGE", "openai/gpt-4o-mini,hosted_vllm/judge=http://127.0.0.1:9/v1")
    argv = ("--config", str(config), "--keep-trajectories", "7", "--no-regression-guard", "--log-to", "tensorboard",
            "--data-dir", str(tmp_path / "data"), "--vllm-arg=--max-model-len=4096")  # fmt: skip
    printed = _print_config(capsys, *argv)
    tomllib.loads(printed)  # valid TOML
    again = tmp_path / "printed.toml"
    again.write_text(printed)
    monkeypatch.delenv("TRACETRAIN_CANARY")
    monkeypatch.delenv("TRACETRAIN_JUDGE")
    reprinted = _print_config(capsys, "--config", str(again))

    def values(text: str) -> list[str]:  # each line without its origin
        return [line.split("  # ")[0] for line in text.splitlines()]

    assert values(reprinted) == values(printed)
    first = _settings_with_env(argv, monkeypatch)
    second = _settings("--config", str(again))
    assert second == first
    assert second.policy_configs["sql"].judge_rubric == "Shorter SQL wins."


def _settings_with_env(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TRACETRAIN_CANARY", "0.2")
    monkeypatch.setenv("TRACETRAIN_JUDGE", "openai/gpt-4o-mini,hosted_vllm/judge=http://127.0.0.1:9/v1")
    try:
        return _settings(*argv)
    finally:
        monkeypatch.delenv("TRACETRAIN_CANARY")
        monkeypatch.delenv("TRACETRAIN_JUDGE")


def test_print_config_masks_secrets_and_passwords(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("TRACETRAIN_API_KEYS", KEY)
    monkeypatch.setenv("TRACETRAIN_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("TRACETRAIN_POLICY_KEY", f"agent={KEY}x")
    printed = _print_config(capsys, "--database-url", f"postgresql+asyncpg://tt:{PASSWORD}@db/tt")
    assert KEY not in printed and TOKEN not in printed and PASSWORD not in printed
    assert '# api-keys = ["********"]  # env TRACETRAIN_API_KEYS (a secret' in printed
    assert "# admin-token = " in printed and "database-url = " in printed


def test_a_renamed_variable_still_works_with_a_warning_naming_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACETRAIN_HEADER_TIMEOUT_S", "9")
    monkeypatch.setenv("TRACETRAIN_UPSTREAMS", "http://a:8000/v1,http://b:8000/v1")
    with pytest.warns(FutureWarning) as caught:
        settings = _settings()
    said = sorted(str(w.message) for w in caught)
    assert len(said) == 2 and "TRACETRAIN_HEADER_TIMEOUT_S is deprecated" in said[0] and said[0].endswith(
        "set TRACETRAIN_HEADER_TIMEOUT") and said[1].endswith("set TRACETRAIN_UPSTREAM")
    assert settings.header_timeout_s == 9
    assert settings.upstreams == ("http://a:8000/v1", "http://b:8000/v1")
    monkeypatch.setenv("TRACETRAIN_HEADER_TIMEOUT", "10")  # the new name wins, without a word on the old one
    with pytest.warns(FutureWarning, match="TRACETRAIN_UPSTREAMS"):
        assert _settings().header_timeout_s == 10


def test_a_config_file_refuses_what_no_flag_has_and_values_a_flag_refuses(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("header-timout = 3\n")
    with pytest.raises(SystemExit, match="no such setting: header-timout"):
        main(["serve", "--print-config", "--config", str(config)])
    config.write_text('adapter-delivery = "carrier-pigeon"\n')
    with pytest.raises(SystemExit, match=r"file .--adapter-delivery.: .carrier-pigeon. is not one of"):
        main(["serve", "--print-config", "--config", str(config)])
    config.write_text("[policies.agent]\ngroup-size = 0\n")
    with pytest.raises(SystemExit, match=r"\[policies.agent\]: group_size: Input should be greater"):
        main(["serve", "--print-config", "--config", str(config)])


def test_every_command_is_walked() -> None:
    names = {" ".join(words) for words, _ in commands()}
    assert {"serve", "model pull", "export", "sft", "db current", "db upgrade", "db prune", "demo"} <= names
    assert list(subcommand_chain(build_parser(), ["db", "prune", "--dry-run"]))[-1][1] == ["--dry-run"]


def test_a_policys_table_names_the_model_names_it_serves(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('policy = ["agent", "sql"]\nmodel-alias = ["*=agent"]\n'
                      '[policies.sql]\nmodel-alias = ["gpt-4o-mini", "claude-haiku-4-5"]\n')  # fmt: skip
    settings = _settings("--config", str(config))
    assert settings.model_aliases == (("*", "agent"), ("gpt-4o-mini", "sql"), ("claude-haiku-4-5", "sql"))
    assert settings.policy_configs == {}


def test_the_configuration_reference_is_the_one_the_declarations_make() -> None:
    from tracetrain_cli._config_docs import page

    written = (Path(__file__).parent.parent / "docs" / "CONFIGURATION.md").read_text()
    assert written == page(build_parser(), demo_parser()), (
        "docs/CONFIGURATION.md is stale: tracetrain config docs > docs/CONFIGURATION.md"
    )


# Flags of other programs that the docs name: vLLM's, pip's, torchrun's, nvidia-smi's, TensorBoard's, MLflow's,
# Claude Code's (--allowedTools, read in lower case), uvicorn's, py-spy's.
OTHER_PROGRAMS = frozenset({
    "--enable-lora", "--enable-sleep-mode", "--max-lora-rank", "--max-model-len", "--max-cpu-loras", "--api-key",
    "--generation-config", "--override-generation-config", "--no-enable-chunked-prefill", "--block-size",
    "--structured-outputs-config", "--extra-index-url", "--query-gpu", "--logdir", "--backend-store-uri",
    "--allowed", "--tools", "--http", "--loop", "--interface", "--idle", "--nonblocking",
    "--dist", "--durations", "--junitxml",  # pytest's
})  # fmt: skip


def test_the_docs_name_only_flags_that_exist() -> None:
    import re

    root = Path(__file__).parent.parent
    known = set(OTHER_PROGRAMS)
    for _, parser in commands():
        known |= {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    # The project's other programs: python -m trainer (and trainer.pull, trainer.sft), bench/, docs/screenshots.py.
    for source in [*root.glob("trainer/*.py"), *root.glob("tracetrain_core/*.py"), *root.glob("bench/**/*.py"),
                   *root.glob("docs/*.py")]:  # fmt: skip
        flags = set(re.findall(r"\"(--[a-z][a-z0-9-]*)\"", source.read_text()))
        known |= flags | {"--no-" + flag[2:] for flag in flags}  # a BooleanOptionalAction's other half
    unknown = {}
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for flag in re.findall(r"(?<![\w/-])--[a-z][a-z0-9-]*[a-z0-9]", page.read_text()):
            if flag not in known:
                unknown.setdefault(flag, page.name)
    assert not unknown, f"flags no command has: {unknown}"
