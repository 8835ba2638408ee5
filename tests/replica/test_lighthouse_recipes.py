"""The recipes that keep a replica job's lighthouse up (examples/lighthouse/), checked as far as this machine allows:
the Kubernetes manifest parsed and its lighthouse command parsed by ``lightning-ft``'s own parser; the SLURM batch
script run on this machine with stand-ins for ``srun`` and ``scontrol`` and a group command that only reports what
it was given (its lighthouse loop is the one tests/replica/test_replica_lighthouse_e2e.py kills and restarts under
training groups)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT, subprocess_env

RECIPES = Path(REPO_ROOT) / "examples" / "lighthouse"


def test_the_kubernetes_manifest_restarts_one_lighthouse_behind_a_stable_address() -> None:
    from lightning_ft.cli import build_parser

    deployment, service = yaml.safe_load_all((RECIPES / "lighthouse.yaml").read_text())
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"  # never two lighthouses at once
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Always"
    assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"] == service["spec"]["selector"]
    lost_node = {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]}
    assert lost_node == {"node.kubernetes.io/unreachable": 30, "node.kubernetes.io/not-ready": 30}
    [container] = pod["containers"]
    command = container["command"]
    assert command[:2] == ["lightning-ft", "lighthouse"]
    args = build_parser().parse_args(command[1:])  # what `lightning-ft lighthouse` would make of it
    port = int(args.bind.rsplit(":", 1)[1])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert container["readinessProbe"]["tcpSocket"]["port"] == container["livenessProbe"]["httpGet"]["port"] == port
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, port)]


def _stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.timeout(300)
def test_the_slurm_script_starts_the_lighthouse_loop_one_group_per_node_and_stops_the_loop(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: run the command after its options; scontrol show hostnames: one node name a line.
    _stand_in(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    _stand_in(bin_dir, "scontrol", 'echo "$3" | tr , "\\n"\n')
    report = (
        "import json, os, urllib.request;"
        "address = os.environ['TORCHFT_LIGHTHOUSE'];"
        "answers = urllib.request.urlopen(address + '/', timeout=30).status == 200;"
        "keys = ('TORCHFT_LIGHTHOUSE', 'REPLICA_GROUP_ID', 'NUM_REPLICA_GROUPS');"
        "record = {k: os.environ[k] for k in keys} | {'answers': answers};"
        f"open('{tmp_path}/group-' + os.environ['REPLICA_GROUP_ID'] + '.json', 'w').write(json.dumps(record))"
    )
    _stand_in(bin_dir, "group", f'exec {sys.executable} -c "{report}"\n')
    env = subprocess_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_NNODES="3",
        SLURM_JOB_NODELIST="node-a,node-b,node-c",
        SLURM_CPUS_ON_NODE="2",
        SLURM_SUBMIT_DIR=REPO_ROOT,
        LIGHTHOUSE_BIND="127.0.0.1:0",
        LIGHTHOUSE_COMMAND=f"{sys.executable} -m lightning_ft.cli lighthouse",
        TRAIN_COMMAND="group",
    )
    done = subprocess.run(
        ["bash", str(RECIPES / "slurm_replica_groups.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    address = (tmp_path / "lighthouse-4242.env").read_text().strip().removeprefix("TORCHFT_LIGHTHOUSE=")
    groups = [json.loads((tmp_path / f"group-{i}.json").read_text()) for i in range(3)]
    assert groups == [
        {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(i), "NUM_REPLICA_GROUPS": "3", "answers": True}
        for i in range(3)
    ]
    # The loop stopped the lighthouse when the groups ended: nothing listens at its address any more.
    import urllib.request

    with pytest.raises(OSError):
        urllib.request.urlopen(address + "/", timeout=5)
