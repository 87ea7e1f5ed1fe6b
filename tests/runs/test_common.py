"""`runs.common`: the synthetic task's splits."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import omegaconf

from tunix_blockdiff import tasks
from tunix_blockdiff.runs import common


@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(["reverse", "sort", "add"]),
    num_train=st.integers(0, 40),
    num_eval=st.integers(1, 12),
    seed=st.integers(0, 1000),
)
def test_held_out_split_alone_equals_the_full_builds(
    name, num_train, num_eval, seed
):
  """`train=False` draws no training examples and the same held-out split."""
  cfg = omegaconf.OmegaConf.create(
      {"name": name, "num_train": num_train, "num_eval": num_eval,
       "seed": seed})
  build = dict(tokenizer=tasks.CharTokenizer(), seq_len=48, vocab_size=64,
               mask_token_id=63)
  full = common.build_task_data(cfg, **build)
  held_out = common.build_task_data(cfg, train=False, **build)
  assert held_out.train == [] and len(full.eval) == num_eval
  assert held_out.eval_pairs == full.eval_pairs
  for got, want in zip(held_out.eval, full.eval, strict=True):
    np.testing.assert_array_equal(got.prompt, want.prompt)
    np.testing.assert_array_equal(got.completion, want.completion)
    assert got.example_id == want.example_id
  # The full build's training prompts never include a held-out one.
  held = {p for p, _ in full.eval_pairs}
  assert len(full.train) <= num_train
  assert not held & {
      tasks.CharTokenizer().decode(e.prompt.tolist()) for e in full.train}
