"""The process group from torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), as on several
machines, here on loopback: two ranks started by `torchrun` load a tiny checkpoint's shards and give the whole
model's logits; and the variables' absence is a clear error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from llm_runtime.distributed.group import init_tensor_parallel
from llm_runtime.distributed.launch import free_port
from llm_runtime.model import load_checkpoint

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from pathlib import Path
    from llm_runtime.distributed.group import init_tensor_parallel
    from llm_runtime.model import load_checkpoint

    tp = init_tensor_parallel(timeout_s=60)  # rank, size and the rendezvous from torchrun's environment
    model = load_checkpoint(Path(sys.argv[1]), device=torch.device("cpu"), dtype=torch.float64, tensor_parallel=tp)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor([[5, 17, 3, 42, 8, 11]])))
    if tp.is_first:
        torch.save(logits, sys.argv[2])
    tp.close()  # every rank leaves together
""")


def test_torchrun_ranks_form_the_group_and_give_the_whole_models_logits(tiny_checkpoints, tmp_path: Path) -> None:
    folder = tiny_checkpoints["qwen3"]
    script, out = tmp_path / "rank.py", tmp_path / "logits.pt"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(folder),
                           str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    whole = load_checkpoint(folder, device=torch.device("cpu"), dtype=torch.float64)
    with torch.inference_mode():
        expected = whole.compute_logits(whole(torch.tensor([[5, 17, 3, 42, 8, 11]])))
    assert (torch.load(out) - expected).abs().max().item() < 1e-10


def test_without_an_address_or_the_environment_it_says_what_is_missing(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        init_tensor_parallel()
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        init_tensor_parallel(0, 2)
    assert init_tensor_parallel(0, 1).size == 1  # one rank needs no group
