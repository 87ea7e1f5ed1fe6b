"""`engine_common.completions`: rows cut before their first EOS."""

from hypothesis import given
from hypothesis import strategies as st
import numpy as np

from tunix_blockdiff.rollout import engine_common


class _Chars:

  def decode(self, ids):
    return "".join(chr(ord("a") + i) for i in ids)


@given(
    st.lists(
        st.lists(st.integers(0, 4), min_size=5, max_size=5),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([3, None]),
)
def test_rows_and_aligned_arrays_end_before_the_first_eos(rows, eos):
  tokens = np.asarray(rows, np.int32)
  logprobs = -np.arange(tokens.size, dtype=np.float32).reshape(tokens.shape)
  cut, texts, (cut_logprobs,) = engine_common.completions(
      tokens, eos, _Chars(), logprobs
  )
  for b, row in enumerate(rows):
    end = row.index(eos) if eos in row else len(row)
    np.testing.assert_array_equal(cut[b], row[:end])
    np.testing.assert_array_equal(cut_logprobs[b], logprobs[b, :end])
    assert texts[b] == _Chars().decode(row[:end])
    assert eos not in cut[b].tolist()


def test_without_aligned_arrays_the_third_result_is_empty():
  cut, texts, aligned = engine_common.completions(
      np.asarray([[1, 3, 2]]), 3, _Chars()
  )
  assert [c.tolist() for c in cut] == [[1]] and texts == ["b"]
  assert aligned == []
