"""Edit similarity and first-line extraction."""

from hypothesis import given
from hypothesis import strategies as st
import pytest

from tunix_blockdiff import metrics

_TEXT = st.text(alphabet="abc\n", max_size=12)
_IDS = st.lists(st.integers(0, 3), max_size=12)


def _reference_levenshtein(a, b):
  row = list(range(len(b) + 1))
  for i, x in enumerate(a, start=1):
    new = [i]
    for j, y in enumerate(b, start=1):
      new.append(min(row[j] + 1, new[j - 1] + 1, row[j - 1] + (x != y)))
    row = new
  return row[-1]


@pytest.mark.parametrize(
    "a, b, distance",
    [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3), ("ab", "ba", 2)],
)
def test_levenshtein_known_values(a, b, distance):
  assert metrics.levenshtein(a, b) == distance


@given(_TEXT, _TEXT)
def test_levenshtein_matches_the_textbook_recursion(a, b):
  assert metrics.levenshtein(a, b) == _reference_levenshtein(a, b)


@given(_IDS, _IDS)
def test_edit_similarity_is_symmetric_and_bounded(a, b):
  value = metrics.edit_similarity(a, b)
  assert value == metrics.edit_similarity(b, a)
  assert 0.0 <= value <= 1.0
  assert (value == 1.0) == (a == b)


@given(_TEXT)
def test_edit_similarity_identity(a):
  assert metrics.edit_similarity(a, a) == 1.0


def test_edit_similarity_values():
  assert metrics.edit_similarity("", "") == 1.0
  assert metrics.edit_similarity("abcd", "") == 0.0
  assert metrics.edit_similarity("abcd", "abce") == 0.75
  assert metrics.edit_similarity([1, 2, 3, 4], [1, 2]) == 0.5


def test_first_line():
  assert metrics.first_line("def f():\n  return 1") == "def f():"
  assert metrics.first_line("a\r\nb") == "a"
  assert metrics.first_line("") == ""
  with pytest.raises(TypeError, match="text must be a str"):
    metrics.first_line(b"x")
