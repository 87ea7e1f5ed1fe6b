"""Tests for the `tunix-blockdiff` command dispatcher."""

from tunix_blockdiff import cli
from tunix_blockdiff.jobs import bench


def test_help_lists_every_command(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  for name in cli.COMMANDS:
    assert name in out


def test_unknown_command_is_an_error(capsys):
  assert cli.main(["nope"]) == 2
  assert "unknown command" in capsys.readouterr().err


def test_bench_unknown_name_is_an_error(capsys):
  assert cli.main(["bench", "no_such_benchmark"]) == 2
  assert "unknown benchmark" in capsys.readouterr().err


def test_bench_runs_a_script(tmp_path, monkeypatch, capsys):
  script = tmp_path / "hello.py"
  script.write_text("import sys\nprint('args', sys.argv[1:])\n")
  monkeypatch.setattr(bench, "BENCHMARKS_DIR", tmp_path)
  assert cli.main(["bench", "hello", "--x", "1"]) == 0
  assert "args ['--x', '1']" in capsys.readouterr().out
