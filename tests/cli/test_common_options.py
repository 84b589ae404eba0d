"""--home (and --models-home, --model) read by every command, before or after its name, through
the one overlay; --data-dir still read where it was (serve, gateway). No engine starts here."""

from __future__ import annotations

import ast
import json
import os
import shlex
from pathlib import Path

import pytest

import kvmem
from kvmem.cli import build_parser, leaf_commands, main
from kvmem.config_overlay import from_args

# What a command needs besides the common options to parse; a new command with required
# arguments fails below until it is listed here, which is the point: it must be checked too.
REQUIRED = {
    ("add",): ["--user", "u", "a fact"],
    ("search",): ["--user", "u", "a query"],
    ("chat",): ["--user", "u"],
    ("forget",): ["--user", "u", "--all"],
    ("get",): ["f-1"],
    ("history",): ["f-1"],
    ("update",): ["f-1", "new text"],
    ("export",): ["--all"],
    ("import",): ["facts.jsonl"],
    ("gateway",): ["--replicas", "http://127.0.0.1:9"],
    ("mcp",): ["--user", "u"],
}
COMMANDS = [path for path, _ in leaf_commands(build_parser())]


def test_the_walk_finds_every_kind_of_command():
    assert {("add",), ("chat",), ("demo",), ("replica",), ("serve",), ("gateway",), ("bench", "ttft"),
            ("eval", "locomo"), ("tune-reader",), ("config", "show"), ("list",), ("get",), ("history",),
            ("update",), ("stats",), ("export",), ("import",)} <= set(COMMANDS)


def _config(args):
    """The Config the command itself would build from these parsed flags."""
    if args.command in ("serve", "gateway"):
        from kvmem.server.cli import settings_of

        return settings_of(args, os.environ, gateway=args.command == "gateway")[1]
    return from_args(args).config


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) for p in COMMANDS])
def test_home_models_home_and_model_before_or_after_the_command(path, where, tmp_path, monkeypatch):
    monkeypatch.delenv("KVMEM_HOME", raising=False)
    monkeypatch.delenv("KVMEM_MODEL", raising=False)
    common = ["--home", str(tmp_path / "h"), "--models-home", str(tmp_path / "m"), "--model", "gemma3-270m"]
    rest = [*path, *REQUIRED.get(path, [])]
    args = build_parser().parse_args([*common, *rest] if where == "before" else [*rest, *common])
    config = _config(args)
    assert (config.home, config.models_home, config.engine.model) == (tmp_path / "h", tmp_path / "m", "gemma3-270m")


@pytest.mark.parametrize("path", COMMANDS, ids=[" ".join(p) for p in COMMANDS])
def test_the_flag_after_the_command_wins_over_the_one_before(path, tmp_path):
    rest = [*path, *REQUIRED.get(path, [])]
    args = build_parser().parse_args(["--home", str(tmp_path / "before"), *rest, "--home", str(tmp_path / "after")])
    assert _config(args).home == tmp_path / "after"


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_data_dir_is_still_read_by_serve_and_gateway_as_home(command, tmp_path, capsys):
    from kvmem.server.cli import build_parser as server_parser
    from kvmem.server.cli import settings_of

    rest = REQUIRED.get((command,), [])
    kvmem_parser, alone = build_parser(), server_parser(gateway=command == "gateway")
    for parser, argv in ((kvmem_parser, [command, *rest]),  # kvmem serve ...
                         (alone, rest)):  # python -m kvmem.server ...
        new = parser.parse_args([*argv, "--home", str(tmp_path / "d")])
        old = parser.parse_args([*argv, "--data-dir", str(tmp_path / "d")])
        assert "--data-dir is deprecated; use --home" in capsys.readouterr().err
        for args in (new, old):
            assert settings_of(args, {}, gateway=command == "gateway")[1].home == tmp_path / "d"
    helps = [alone.format_help(), dict(leaf_commands(kvmem_parser))[(command,)].format_help()]
    assert all("--home" in text and "--data-dir" not in text for text in helps)  # hidden, deprecated


def test_data_dir_is_not_spread_to_the_other_commands():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["search", "--user", "u", "--data-dir", "/x", "q"])


@pytest.fixture
def server_env(monkeypatch):
    """serve sets these with setdefault; set here, monkeypatch restores them after the test."""
    monkeypatch.delenv("KVMEM_API_KEYS", raising=False)
    monkeypatch.delenv("KVMEM_ENGINE_URL", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def test_kvmem_serve_and_gateway_run_with_the_home_given_before_them(server_env, monkeypatch, tmp_path, capsys):
    import kvmem.server.cli as server_cli

    started = []
    monkeypatch.setattr(server_cli, "_run", lambda settings, config: started.append((settings, config)) or 0)
    assert main(["--home", str(tmp_path / "s"), "serve", "--port", "8123"]) == 0
    assert main(["--home", str(tmp_path / "g"), "gateway", "--replicas", "http://127.0.0.1:9", "--port", "8124"]) == 0
    assert [(s.port, c.home) for s, c in started] == [(8123, tmp_path / "s"), (8124, tmp_path / "g")]
    assert started[1][1].engine.url == "http://127.0.0.1:9"
    assert main(["gateway", "--home", str(tmp_path / "g")]) == 2
    assert "a gateway needs replicas" in capsys.readouterr().err


def test_replica_takes_its_shared_tier_through_the_overlay(tmp_path, capsys):
    from kvmem.config import default_home

    argv = ["replica", "--print", "--home", str(tmp_path), "--models-home", str(default_home() / "models"),
            "--kv-shared-url", "redis://cache:6379/0"]
    assert main(argv) == 0
    words = shlex.split(capsys.readouterr().out)
    extra = json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["shared_url"] == "redis://cache:6379/0" and extra["kv_dir"] == str(tmp_path / "kv")


def test_nothing_below_the_command_line_imports_it():
    """cli is the top layer: bench/ and tune/ (and everything else) must not import kvmem.cli."""
    root = Path(kvmem.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if root / "cli" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            if any(n == "kvmem.cli" or n.startswith("kvmem.cli.") for n in names):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
