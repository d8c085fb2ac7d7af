"""muP's coordinate check (as the `mup` package's): train models of widths 64..512 a few steps from
one seed and record each activation's size (mean |x| per coordinate) and its change from init.
Under muP (`model.mup`) both stay flat across widths; under the standard parametrization they
grow with width. `tests/test_mup.py` asserts the flatness; this script also draws the figure:

    OMP_NUM_THREADS=1 python -m bench.mup_coord_check --out docs/mup_coord_check.png
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from model import GPT, ModelConfig
from model.mup import lr_multiplier
from train.config import OptimConfig, TrainConfig
from train.optim import MuonAdamW, param_groups

WIDTHS = (64, 128, 256, 512)
BASE = ModelConfig(n_layer=2, n_head=4, n_embd=64, ffn_hidden=256, vocab_size=128, max_seq_len=32,
                   mup_base_width=64)


def _optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The run's optimizer with each group at its lr (lr x lr_scale, as the schedule sets it)."""
    multiplier = (lambda p, muon: lr_multiplier(model, cfg.optim.muon_adjust_lr, p, muon)) if model.cfg.mup else None
    groups = param_groups(model, cfg, multiplier)
    for group in groups:
        group["lr"] = cfg.optim.lr * group["lr_scale"]
    if cfg.optim.name == "muon":
        optimizer = MuonAdamW(groups, cfg)
        for group in optimizer.param_groups:
            group["lr"] = cfg.optim.lr * group["lr_scale"]
        return optimizer
    return torch.optim.AdamW([{k: v for k, v in g.items() if k != "use_muon"} for g in groups],
                             betas=(cfg.optim.beta1, cfg.optim.beta2))


def _activations(model: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The embedding's, each block's and the logits' outputs on idx."""
    out: dict[str, torch.Tensor] = {}
    hooks = [model.wte.register_forward_hook(lambda m, i, o: out.__setitem__("embedding", o))]
    for n, block in enumerate(model.h):
        hooks.append(block.register_forward_hook(lambda m, i, o, n=n: out.__setitem__(f"block {n}", o)))
    with torch.no_grad():
        out["logits"] = model(idx)
    for hook in hooks:
        hook.remove()
    return out


def coordinates(mup: bool, optimizer: str = "adamw", widths: tuple[int, ...] = WIDTHS, steps: int = 3,
                seeds: int = 2, lr: float = 1e-2) -> dict[str, dict[int, tuple[float, float]]]:
    """activation -> width -> (mean |x| after `steps` steps, mean |x - x at init|), averaged over seeds."""
    sums: dict[str, dict[int, list[float]]] = {}
    for width in widths:
        for seed in range(seeds):
            torch.manual_seed(seed)
            model_cfg = replace(BASE, n_embd=width, ffn_hidden=4 * width, mup=mup)
            model = GPT(model_cfg)
            cfg = TrainConfig(model=model_cfg, optim=OptimConfig(name=optimizer, lr=lr, weight_decay=0.0,
                                                                 muon_weight_decay=0.0, muon_lr=lr))
            opt = _optimizer(model, cfg)
            gen = torch.Generator().manual_seed(100 + seed)
            probe = torch.randint(0, BASE.vocab_size, (4, BASE.max_seq_len), generator=gen)
            start = _activations(model, probe)
            for _ in range(steps):
                tokens = torch.randint(0, BASE.vocab_size, (8, BASE.max_seq_len + 1), generator=gen)
                opt.zero_grad()
                model(tokens[:, :-1], tokens[:, 1:]).backward()
                opt.step()
            end = _activations(model, probe)
            for name, x in end.items():
                entry = sums.setdefault(name, {}).setdefault(width, [0.0, 0.0])
                entry[0] += float(x.abs().mean()) / seeds
                entry[1] += float((x - start[name]).abs().mean()) / seeds
    return {name: {w: (v[0], v[1]) for w, v in by_width.items()} for name, by_width in sums.items()}


def spread(values: dict[int, float]) -> float:
    """max / min over widths: 1 is perfectly flat."""
    return max(values.values()) / min(values.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/mup_coord_check.png")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(mup, opt) for opt in ("adamw", "muon") for mup in (False, True)]
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 7), sharex=True)
    for col, (mup, opt) in enumerate(panels):
        data = coordinates(mup, opt, steps=args.steps)
        for row, (index, label) in enumerate(((0, "mean |x|"), (1, "mean |x - x0|"))):
            ax = axes[row, col]
            for name, by_width in data.items():
                ax.plot(list(by_width), [v[index] for v in by_width.values()], marker="o", label=name)
                flatness = spread({w: v[index] for w, v in by_width.items()})
                print(f"{opt} mup={mup} {label} {name}: spread {flatness:.2f}")
            ax.set(xscale="log", yscale="log", xlabel="width", ylabel=label,
                   title=f"{opt}, {'muP' if mup else 'standard'}, step {args.steps}")
            ax.set_xticks(list(WIDTHS), [str(w) for w in WIDTHS])
            ax.minorticks_off()
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
