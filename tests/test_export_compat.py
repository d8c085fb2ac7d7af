"""Exports made by an earlier version keep loading: `tests/fixtures/export_before_one_decoder` is a
tiny random CoCA-strict model with the length temperature (neox, 2 layers of width 16), exported
by the code before the export shipped the model's own decoder (its config says `coca_form`, its
remote code is the hand-kept copy of the blocks). Transformers loads it with the code it ships, and
this project imports it (`init_from`): both give the same logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hf.imports import import_hf
from model import GPT
from model.designs import DESIGNS

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "export_before_one_decoder"


def test_an_export_made_before_one_decoder_loads_in_transformers_and_here(tmp_path):
    from transformers import AutoModelForCausalLM

    export = shutil.copytree(FIXTURE, tmp_path / "old_export")
    cfg, state = import_hf(export)
    assert cfg.design is DESIGNS["coca_strict"] and cfg.length_temperature and cfg.max_seq_len == 32
    ours = GPT(cfg).double().eval()
    ours.load_state_dict(state)
    theirs = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).double().eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))  # past L0: the
    with torch.no_grad():  # temperature acts
        torch.testing.assert_close(theirs(input_ids=idx).logits, ours(idx), rtol=0, atol=1e-10)
