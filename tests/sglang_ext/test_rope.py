"""RoPE's cos/sin on the CPU (models/llama.py rope_cos_sin): a table of every position made once per model and
dtype, each call's rows indexed from it; what it gives against computing them, and where it is not made."""

import torch
from helpers import tiny_config, tiny_state

from sglang_ext.models import llama
from sglang_ext.models.llama import LlamaModel, rope_cos_sin, rope_inv_freq, rope_of
from sglang_ext.models.moa import MoAConfig, MoADraft


def _inv(d: int = 64) -> torch.Tensor:
    return 1.0 / (100000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()


def test_the_tables_rows_are_the_computed_cos_and_sin():
    inv, tables = _inv(), {}
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 8192 + llama.ROPE_SLACK, (37,), generator=g)
    cos, sin = rope_cos_sin(inv, pos, torch.float32, tables, 8192)
    ref = rope_of(inv, pos, torch.float32)
    assert cos.shape == ref[0].shape == (37, 1, 64)
    torch.testing.assert_close(cos, ref[0], rtol=0, atol=2e-6)  # (vectorised and scalar cos may differ by an ulp)
    torch.testing.assert_close(sin, ref[1], rtol=0, atol=2e-6)
    # any shape of positions (training passes [B, T]); other dtypes get tables of their own
    grid = pos[:36].view(4, 9)
    assert torch.equal(rope_cos_sin(inv, grid, torch.float32, tables, 8192)[0], cos[:36].view(4, 9, 1, 64))
    half = rope_cos_sin(inv, pos, torch.bfloat16, tables, 8192)[0]
    assert half.dtype == torch.bfloat16 and set(tables) == {torch.float32, torch.bfloat16}


def test_the_table_is_made_once_and_a_positions_rows_do_not_depend_on_the_call():
    inv, tables = _inv(), {}
    one = rope_cos_sin(inv, torch.tensor([700]), torch.float32, tables, 4096)
    table = tables[torch.float32]
    many = rope_cos_sin(inv, torch.tensor([3, 700, 4095, 12]), torch.float32, tables, 4096)
    assert tables[torch.float32] is table  # not rebuilt
    assert table[0].shape == (4096 + llama.ROPE_SLACK, 1, 64)
    assert torch.equal(one[0][0], many[0][1]) and torch.equal(one[1][0], many[1][1])


def test_no_table_where_it_would_not_fit_or_off_the_cpu(monkeypatch):
    inv, tables = _inv(128), {}
    monkeypatch.setattr(llama, "ROPE_TABLE_BYTES", 1024)
    pos = torch.tensor([5, 90_000])
    cos, sin = rope_cos_sin(inv, pos, torch.float32, tables, 131_072)
    assert tables == {}
    assert torch.equal(cos, rope_of(inv, pos, torch.float32)[0]) and torch.equal(
        sin, rope_of(inv, pos, torch.float32)[1]
    )


def test_a_target_and_its_drafters_index_their_tables():
    cfg = tiny_config(vocab=64, layers=4)
    target, draft = LlamaModel(cfg, tiny_state(cfg, 0)), MoADraft(MoAConfig.for_target(cfg, draft_vocab_size=48))
    pos = torch.tensor([0, 5, 17])
    cos, sin = target.rope(pos)
    assert set(target._rope_tables) == {target.dtype}
    inv = rope_inv_freq(target.cfg)
    torch.testing.assert_close(cos, rope_of(inv, pos, target.dtype)[0], rtol=0, atol=2e-6)
    dc, _ = draft.rope(pos, torch.float32)
    assert set(draft._rope_tables) == {torch.float32}
    torch.testing.assert_close(dc, rope_of(draft.inv_freq, pos, torch.float32)[0], rtol=0, atol=2e-6)
