"""The training loss is the global batch's token mean (issue 20, item 1): one step's gradient is
that of (sum of token losses over the global batch) / (its counted targets), whatever the
micro-batch size, gradient accumulation, world size or ZeRO stage.

The batch discriminates: answer-only passkey rows (6 counted targets each) beside full text rows
(192), so the old normalisation (each micro-batch its own mean, micro-batches and ranks weighted
equally) gives a gradient far from the token mean. Real DeepSpeed on 1 and 2 gloo ranks
(tests/token_weighted_grads.py), against a float64 PyTorch reference without DeepSpeed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from test_train_e2e import _free_port, _logged_batches, train_two_ranks
from token_weighted_grads import SEED, config

from data.config import DataConfig, SourceConfig
from data.loader import build_loader
from data.synthetic import SyntheticCursor, split_block
from model import GPT
from run_checks import clean_env, losses, ok
from train.config import to_train_config
from train.engine import param_groups
from train.schedule import lr_at

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "token_weighted_grads.py"
SEQ_LEN = 192  # the passkey prompt of the 512-piece tokenizer needs 166 tokens
MICRO_4 = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # the rows of micro-batches of 4


@pytest.fixture(scope="module")
def global_batch(tok) -> torch.Tensor:
    """16 blocks `[16, 193]`: rows 0-5 and 8-9 answer-only passkey rows (`data.synthetic`), the rest
    stdlib text (`data.loader`), so micro-batches of 4 hold 24, 396, 396 and 768 counted targets
    and the two ranks' halves 420 and 1164."""
    cursor = SyntheticCursor(SourceConfig(kind="synthetic", task="passkey", loss_on="answer"), tok,
                             seed=0, rank=0, worker=0)
    passkey = [torch.from_numpy(cursor.next_block(SEQ_LEN + 1)) for _ in range(8)]
    text = next(iter(build_loader(DataConfig(), tok, split="train", seq_len=SEQ_LEN, batch_size=8)))
    return torch.stack([*passkey[:6], text[0], text[1], *passkey[6:], *text[2:]])


def reference(batch: torch.Tensor, normaliser: float) -> tuple[dict[str, torch.Tensor], float]:
    """float64 PyTorch, no DeepSpeed and not the model's own loss: the gradient of the rows' summed
    cross entropy / `normaliser` (at the script's initial weights), and that loss."""
    torch.manual_seed(SEED)
    model = GPT(config(0, 16, SEQ_LEN).model).double()
    idx, targets = split_block(batch)
    logits = model(idx)
    summed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    (summed / normaliser).backward()
    return {name: p.grad for name, p in model.named_parameters()}, summed.item() / normaliser


def counted(batch: torch.Tensor) -> int:
    return int((split_block(batch)[1] != -100).sum())


def gradients(batch_path: Path, out: Path, ranks: int, *cases: str) -> dict:
    """The script's results for `cases`, on `ranks` processes (two: the `deepspeed` launcher)."""
    launch = ([sys.executable] if ranks == 1 else
              ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(_free_port())])
    done = subprocess.run([*launch, str(SCRIPT), str(batch_path), str(out), *cases], cwd=REPO,
                          env=clean_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    ok(done)
    return torch.load(out)


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(float((got[name].double() - want[name]).abs().max()) for name in want)


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float(((got[name].double() - want[name]) ** 2).sum()) for name in want)
    return (num / sum(float((g**2).sum()) for g in want.values())) ** 0.5


def test_one_step_gradient_is_the_global_token_mean_for_every_split(global_batch, tmp_path):
    """micro 16 (accumulation 1), 4 x 4 accumulation (ZeRO 0 and 2) on one rank; 2 ranks x 8 under
    ZeRO 2, and 2 ranks with accumulation under ZeRO 0 (2 x 4), 1 (4 x 2) and 3 (2 x 4): every
    full gradient equals micro 16's and the float64 reference's to 1e-6, and every logged loss the
    reference loss. The old mean of means differs from it by far more than 1e-3 (relative)."""
    counts = [counted(global_batch[rows]) for rows in MICRO_4]
    assert counts == [24, 396, 396, 768] and counted(global_batch) == 1584
    batch_path = tmp_path / "batch.pt"
    torch.save(global_batch, batch_path)
    one = gradients(batch_path, tmp_path / "one.pt", 1, "0:16:tokens", "0:4:tokens", "2:4:tokens", "0:4:mean",
                    "0:4:skip")
    two = gradients(batch_path, tmp_path / "two.pt", 2, "2:8:tokens", "0:2:tokens", "1:4:tokens", "3:2:tokens",
                    "2:8:mean")
    want, want_loss = reference(global_batch, counted(global_batch))
    single = one["0:16:tokens"]["grads"]
    assert max_diff(single, want) < 1e-6
    for results in (one, two):
        for case, result in results.items():
            if case.endswith(":tokens"):
                assert max_diff(result["grads"], want) < 1e-6, case
                assert max(float((result["grads"][name] - single[name]).abs().max()) for name in want) < 1e-6, case
                assert result["loss"] == pytest.approx(want_loss, rel=1e-6), case
    assert relative(one["0:4:mean"]["grads"], want) > 1e-3 and relative(two["2:8:mean"]["grads"], want) > 1e-3
    assert abs(one["0:4:mean"]["loss"] - want_loss) > 1e-3  # the old logged loss, too

    # A skipped micro-batch (the second, 396 targets) replaced by the next one (here the first again,
    # 24): the step divides by the planned count (1584), and logs the loss over what it trained on.
    trained = global_batch[MICRO_4[0] + MICRO_4[2] + MICRO_4[3] + MICRO_4[0]]
    skipped, skipped_loss = reference(trained, counted(global_batch))
    assert max_diff(one["0:4:skip"]["grads"], skipped) < 1e-6
    assert one["0:4:skip"]["loss"] == pytest.approx(skipped_loss * counted(global_batch) / counted(trained), rel=1e-6)


def _replay(cfg, batches: dict[int, list[list[int]]], micro: int | None = None) -> dict[int, float]:
    """A one-process fp32 PyTorch model (same seed, init, AdamW groups, schedule and clipping) trained
    on the logged global batches; its per-step losses. Each step's loss is the whole batch's token
    mean, or with `micro` the old normalisation: the mean of its micro-batches' means (the logs
    hold rank 0's micro-batches, then rank 1's)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).train()
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    replayed = {}
    for step in sorted(batches):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, o, cfg.max_steps)
        batch = torch.tensor(batches[step])
        parts = [batch] if micro is None else batch.split(micro)
        loss = sum(model(*split_block(part)) for part in parts) / len(parts)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        replayed[step] = loss.item()
    return replayed


def test_two_rank_run_on_passkey_and_text_logs_the_token_mean(tmp_path_factory, tmp_path):
    """`python -m train` itself (2 ranks, ZeRO 2, micro 2 x accumulation 2) on a mixture of
    answer-only passkey rows and text: a one-process replay of the logged global batches on their
    token mean gives every step's logged loss to 1e-5, so the updates agree too; a replay with the
    old mean of micro-batch means is more than 1e-3 away by step 3."""
    cache = tmp_path_factory.mktemp("cache")
    run_dir = tmp_path / "run"
    ok(train_two_ranks(run_dir, cache, "deepspeed=zero2", "batch_size=8", "micro_batch_size=2", "max_steps=3",
                       "eval_every=3", "ckpt_every=3", f"model.max_seq_len={SEQ_LEN}",
                       "data.sources=[{kind:stdlib,weight:0.5},{kind:synthetic,task:passkey,loss_on:answer,weight:0.5}]"))
    cfg = to_train_config(OmegaConf.load(run_dir / "config.yaml"))
    batches = _logged_batches(run_dir, (0, 1), range(1, 4))
    first = torch.tensor(batches[1])
    assert len({counted(part) for part in first.split(2)}) > 1  # its micro-batches hold different counts
    logged, replayed = losses(run_dir), _replay(cfg, batches)
    assert sorted(logged) == sorted(replayed) == [1, 2, 3]
    for step in logged:
        assert replayed[step] == pytest.approx(logged[step], abs=1e-5), (step, replayed, logged)
    old = _replay(cfg, batches, micro=2)
    assert abs(old[3] - logged[3]) > 1e-3, (old, logged)
