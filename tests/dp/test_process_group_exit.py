"""A data-parallel script that never calls `destroy_process_group` (as the stock Trainer and
accelerate do not) still ends with its process groups destroyed before the interpreter's
finalization, after the optimizers' own finalizers: a gloo group left to finalization aborts the
process (std::terminate, exit code -6) after training succeeded. A gloo group's threads end only
with its last reference, so the optimizer drops its groups first: none is left to be freed, its
threads joined, during finalization."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

# What each rank runs. The probe's finalizer is created first, so weakref's exit hook (newest
# first) runs it last: it sees what the interpreter's finalization would be left with.
RANK = textwrap.dedent("""
    import os, sys, weakref
    import torch, torch.distributed as dist

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return sum(name.startswith(("gloo", "pt_gloo")) for name in names)

    class Probe: pass
    probe, report = Probe(), sys.argv[3]
    def at_exit():
        with open(report, "w") as f:
            f.write(f"initialized={dist.is_initialized()} gloo_threads={gloo_threads()} of_default_group={default}")
    weakref.finalize(probe, at_exit)

    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[1]), world_size=2)
    dist.barrier()  # the default group connected: all of its threads started
    default = gloo_threads()
    from superoffload_hf import SuperOffloadAdamW
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, config={"host_threads": 1, "device_dtype": "fp32"})
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    keep = (model, opt)  # still alive at exit: its finalizer closes it there
""")


def test_a_two_rank_script_that_never_destroys_its_process_group_exits_with_it_destroyed(tmp_path,
                                                                                      grace_adam_extension):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(store), str(tmp_path / f"rank{rank}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out[-3000:]}"
        found = dict(kv.split("=") for kv in (tmp_path / f"rank{rank}").read_text().split())
        assert found["initialized"] == "False", out[-3000:]
        # torch keeps the default group alive after destroy_process_group (torch._dynamo, which
        # torch.optim imports, holds it); the optimizer's own groups must be gone, threads joined
        assert int(found["gloo_threads"]) <= int(found["of_default_group"]), found
