"""`models.programs.ProgramCache`: programs by (GraphDef, key), LRU-bounded."""

from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
import pytest

from tunix_blockdiff.models import programs
from tunix_blockdiff.models import tiny as tiny_models


@given(st.integers(1, 4),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=30))
def test_get_builds_once_per_entry_and_evicts_the_least_recently_used(
    bound, calls):
  # GraphDefs compare by value: equal objects stand in for one architecture.
  cache = programs.ProgramCache(bound)
  recent = []  # a reference LRU of (graph, key), the most recent last
  for graph, key in calls:
    built = []
    got = cache.get(("graph", graph), key,
                    lambda: built.append(1) or (graph, key, len(recent)))
    assert built == ([] if (graph, key) in recent else [1])
    if (graph, key) in recent:
      recent.remove((graph, key))
    recent = (recent + [(graph, key)])[-bound:]
    assert got[:2] == (graph, key)
    assert cache.lookup(("graph", graph), key) is got
    assert len(cache) == len(recent)
  for graph in range(3):
    for key in range(4):
      assert (cache.lookup(("graph", graph), key) is None) == (
          (graph, key) not in recent)


def test_models_of_one_architecture_share_and_others_do_not():
  cache = programs.ProgramCache()
  small = [tiny_models.tiny_qwen3(16, seed=s) for s in (0, 1)]
  wide = tiny_models.tiny_qwen3(16, seed=0, embed_dim=48)
  first = cache.get(nnx.graphdef(small[0]), "k", object)
  assert cache.get(nnx.graphdef(small[1]), "k", object) is first
  assert cache.get(nnx.graphdef(wide), "k", object) is not first
  assert cache.get(nnx.graphdef(small[1]), "other", object) is not first
  cache.clear()
  assert len(cache) == 0 and cache.lookup(nnx.graphdef(small[0]), "k") is None


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_a_bound_below_one_is_refused(bad):
  with pytest.raises(ValueError, match="max_programs must be an int >= 1"):
    programs.ProgramCache(bad)
