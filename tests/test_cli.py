"""Tests for the `tunix-blockdiff` command dispatcher."""

from tunix_blockdiff import cli
from tunix_blockdiff.runs import common
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


def _usage_error(capsys, argv):
  """Runs the CLI; asserts a one-line error with status 2; returns it."""
  assert cli.main(argv) == 2
  captured = capsys.readouterr()
  assert "Traceback" not in captured.err
  assert captured.err.count("\n") == 1, captured.err
  assert captured.err.startswith(f"tunix-blockdiff {argv[0]}: error: ")
  return captured.err


def test_recipe_errors_are_one_line_naming_key_value_and_rule(tmp_path, capsys):
  out = f"output_dir={tmp_path}"
  err = _usage_error(capsys, ["sft", out, "training.max_steps=abc"])
  assert "training.max_steps=abc" in err and "must be an int" in err
  err = _usage_error(capsys, ["sft", out, "training.max_steps=null"])
  assert "must be an int" in err
  # Keys whose recipes document null take it.
  cfg = common.load_recipe(["rl_tiny.yaml", "rollout.max_prompt_length=null"])
  assert cfg.rollout.max_prompt_length is None
  err = _usage_error(capsys, ["sft", out, "training.max_step=3"])
  assert "'training.max_step'" in err
  assert "did you mean 'training.max_steps'" in err
  err = _usage_error(capsys, ["sft", out, "diffusion.block_size=0"])
  assert "diffusion.block_size=0 is not valid" in err
  assert "must be an int >= 1" in err
  err = _usage_error(capsys, ["sft", "nope.yaml"])
  assert "nope.yaml" in err and "tiny.yaml" in err
  err = _usage_error(capsys, ["sft", out, "dataset.trian=x.jsonl"])
  assert "did you mean 'dataset.train'" in err
  err = _usage_error(capsys, ["generate", str(tmp_path / "nonexistent")])
  assert "nonexistent" in err and "output_dir of a" in err


def test_a_bad_data_row_names_its_file_and_line(tmp_path, capsys):
  data = tmp_path / "train.jsonl"
  data.write_text('{"prompt": "12", "completion": "21"}\n{"prompt": "1"}\n')
  err = _usage_error(
      capsys,
      [
          "sft",
          f"output_dir={tmp_path / 'run'}",
          f"dataset.train={data}",
          "dataset.bad_rows=error",
          "model.num_layers=1",
      ],
  )
  assert f"{data}:2: missing field 'completion'" in err


def test_internal_failures_keep_their_traceback_and_say_so(
    monkeypatch, tmp_path, capsys):
  from tunix_blockdiff.jobs import sft

  def broken(cfg):
    raise ValueError("an internal bug, not a usage error")

  monkeypatch.setattr(sft, "run", broken)
  assert cli.main(["sft", "training.max_steps=1",
                   f"output_dir={tmp_path}"]) == 1
  err = capsys.readouterr().err
  assert "Traceback" in err and "ValueError: an internal bug" in err
  assert err.strip().splitlines()[-1] == (
      "tunix-blockdiff sft: internal error (a bug in tunix-blockdiff, not in"
      " your recipe): please report it with the traceback above")
