"""Two "nodes" on one host, through the script every multi-node launch uses.

`launch/train_multi_node.sh` twice (NNODES=2, NODE_RANK 0 and 1, one rank each, a c10d rendezvous
on 127.0.0.1) under ZeRO 2 and 3; both nodes get SIGTERM, as a scheduler's preemption delivers
it; the run then resumes on one node with one rank (`launch/train_single_node.sh`): another world
size, so the ZeRO checkpoint goes through DeepSpeed's universal format (`train.elastic`).
`launch/slurm.sbatch` starts the same script on every node.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
from test_train_preempt import (
    REPO,
    SLOW,
    TIMEOUT,
    cache,
    check_resumed,
    check_stopped,
    cleanup,
    env,
    finish,
    free_port,
    overrides,
    start,
    wait_for_step,
)

pytestmark = pytest.mark.slow
__all__ = ["cache"]  # the shared tokenizer cache fixture


@pytest.mark.parametrize("stage", [2, 3])
def test_two_nodes_preempted_then_resumed_on_one(cache, tmp_path, stage):
    run_dir = tmp_path / "run"
    zero = (f"deepspeed=zero{stage}", "micro_batch_size=2")
    port = str(free_port())
    nodes = [start([str(REPO / "launch" / "train_multi_node.sh"), *overrides(run_dir, cache, *zero, SLOW)],
                   NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   RDZV_ID=f"test-{port}")
             for node in (0, 1)]
    with cleanup(*nodes):
        wait_for_step(nodes[0], run_dir, 2)
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        errs = [finish(node) for node in nodes]
    assert [node.returncode for node in nodes] == [128 + signal.SIGTERM] * 2, errs[0][-2000:] + errs[1][-2000:]
    step = check_stopped(run_dir, 0, 2, "".join(errs))

    resumed = subprocess.run([str(REPO / "launch" / "train_single_node.sh"),
                              *overrides(run_dir, cache, *zero, "resume=auto")],
                             cwd=REPO, env=env(NUM_GPUS="1"), capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_resumed(run_dir, step, resumed.stderr)
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "universal").is_dir()
