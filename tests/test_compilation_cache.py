"""The test suite's JAX compilation cache choice (`tests/conftest.py`)."""

import os
import tempfile
import time

import conftest


def test_cache_directory_follows_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  monkeypatch.delenv(conftest.CACHE_ENV, raising=False)
  lasting = conftest._compilation_cache_dir()  # pylint: disable=protected-access
  assert lasting == str(tmp_path / "xdg" / "tunix_blockdiff" /
                        "test_jax_cache")
  assert os.path.isdir(lasting)
  monkeypatch.setenv(conftest.CACHE_ENV, str(tmp_path / "mine"))
  assert conftest._compilation_cache_dir() == str(tmp_path / "mine")  # pylint: disable=protected-access
  # per-run: a directory named by xdist's run id in the temp directory,
  # where other runs' directories unused for 6 h are removed.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  stale = tmp_path / "tmp" / (conftest.CACHE_PREFIX + "old")
  stale.mkdir(parents=True)
  long_ago = time.time() - 7 * 3600
  os.utime(stale, (long_ago, long_ago))
  monkeypatch.setenv(conftest.CACHE_ENV, "per-run")
  monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "abc")
  per_run = conftest._compilation_cache_dir()  # pylint: disable=protected-access
  assert per_run == str(tmp_path / "tmp" / (conftest.CACHE_PREFIX + "abc"))
  assert not stale.exists()


def test_prune_removes_only_entries_unused_for_the_age(tmp_path):
  old, new, old_dir = (tmp_path / "old", tmp_path / "new", tmp_path / "d")
  old.write_bytes(b"x")
  new.write_bytes(b"y")
  old_dir.mkdir()
  (old_dir / "f").write_bytes(b"z")
  long_ago = time.time() - 20 * 86400
  for path in (old, old_dir):
    os.utime(path, (long_ago, long_ago))
  conftest._prune(str(tmp_path), 14 * 86400, prefix="o")  # pylint: disable=protected-access
  assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "new"]
  conftest._prune(str(tmp_path), 14 * 86400)  # pylint: disable=protected-access
  assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]
