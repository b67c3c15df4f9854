"""fmha_rt.torch on DTensors over gloo processes (torch_mesh_worker.py, world sizes 2 and 4): heads and
batch stay sharded through the fwd and bwd ops and every gathered result is bitwise the unsharded
call's; a sequence split is redistributed (replicated) and still exact."""
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed.tensor")

WORKER = pathlib.Path(__file__).with_name("torch_mesh_worker.py")
ROOT = WORKER.parents[2]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def mesh_report(request, tmp_path_factory):
    seed = random.randrange(2**31)
    print(f"torch_mesh_worker world {request.param} seed {seed}")
    out = tmp_path_factory.mktemp("torch_mesh") / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(WORKER), str(request.param), str(seed), str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("case, placement", [("heads", "(Shard(dim=2),)"), ("batch", "(Shard(dim=0),)")])
def test_placements_stay_sharded_and_results_are_bitwise_the_unsharded_call(mesh_report, case, placement):
    report = mesh_report[case]
    assert report["placements"] == [placement] * 4  # out, dq, dk, dv
    assert report["bitwise"] == [True] * 4


def test_a_sequence_split_is_redistributed_and_exact(mesh_report):
    report = mesh_report["sequence_redistributed"]
    assert report["placements"] == ["(Replicate(),)"] * 4
    assert report["bitwise"] == [True] * 4
