"""`tools/stage_hlo.py`: memory-space assignment counted in compiled HLO."""

import pathlib

import pytest


# A compiled program's text as a TPU backend prints it, cut to what the
# summary reads: the entry layouts, two async copies, values in S(1).
TEXT = """HloModule jit_run, entry_computation_layout={(s32[]{:T(128)}, \
bf16[28,32,8,9,16,128]{5,4,3,2,1,0:T(8,128)(2,1)}, \
bf16[256,3072]{1,0:T(8,128)(2,1)})->(s32[]{:T(128)})}

ENTRY %main {
  %cs.1 = (bf16[256,3072]{1,0:T(8,128)(2,1)}, bf16[256,3072]{1,0:T(8,128)(2,1)S(1)}) copy-start(bf16[256,3072]{1,0:T(8,128)(2,1)} %p)
  %cd.1 = bf16[256,3072]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs.1)
  %cs.2 = (f32[32,16]{1,0:T(8,128)}, f32[32,16]{1,0:T(8,128)S(1)}) copy-start(f32[32,16]{1,0:T(8,128)} %q)
}
"""


def test_summary_counts_async_copies_fast_memory_and_entry_layouts(load_tool):
  summary = load_tool("stage_hlo").summarise(TEXT)
  assert summary["copy_starts"] == 2
  assert summary["fast_memory_values"] == 3
  assert summary["most_in_fast_memory"][0] == ("bf16[256,3072]", 2)
  assert summary["largest_entry_layouts"][0] == (
      "bf16[28,32,8,9,16,128]{5,4,3,2,1,0:T(8,128)(2,1)}")


def test_summarise_reads_written_texts_and_refuses_what_it_cannot_run(
    load_tool, tmp_path, capsys):
  tool = load_tool("stage_hlo")
  (tmp_path / "stage_1_phase_0.txt").write_text(TEXT)
  assert tool.main([str(tmp_path), "--summarise"]) == 0
  assert "stage_1_phase_0 {'copy_starts': 2" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    tool.main([str(tmp_path / "empty"), "--summarise"])
  with pytest.raises(SystemExit):
    tool.main([str(tmp_path), "--cache-phases", "1"])
  assert "--cache-phases: >= 2" in capsys.readouterr().err


def test_a_short_case_compiles_only_the_phases_generate_runs(
    load_tool, tmp_path, capsys):
  # 8 new tokens in blocks of 4 make one phase of the two asked for.
  tool = load_tool("stage_hlo")
  assert tool.main([str(tmp_path), "--model", "tiny", "--batch", "2",
                    "--prompt-width", "8", "--new-tokens", "8",
                    "--schedule", "b4s1", "--cache-phases", "2"]) == 0
  assert sorted(p.stem for p in tmp_path.glob("*.txt")) == [
      "one_program", "stage_0_prefill", "stage_1_phase_0", "stage_2_result"]
  assert "stage_1_phase_0 {'copy_starts': 0" in capsys.readouterr().out
