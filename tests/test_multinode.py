"""The multi-node path: two torchrun "nodes" on one machine (rank placement by NODE_RANK, the
region check, what reaches wandb) and the SLURM scripts' node numbering."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, fake_commands, read_jsonl

from protocol_models.training.placement import (
    RankPlace,
    describe_placement,
    interleaved_regions,
    placement_problem,
)


def _two_nodes(
    logs: Path, args: list[str], regions: dict[int, str], env=None, node_args=None
) -> dict[int, tuple[int, str]]:
    """Start ``scripts/train.sh`` as nodes 1 and 0 of a 2-node job on this machine (c10d
    rendezvous on localhost, one process each), node 1 first, with ``REGION`` per node and
    ``node_args[rank]`` after ``args``; return node rank -> (exit code, output). The outputs go
    through files in ``logs``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "NGPU": "1", **(env or {})}  # fmt: skip
    # Node 1 starts first: c10d alone would number the nodes by (host name, launcher pid) and
    # make it node 0, with the global ranks and the pipeline stage meant for node 0.
    logs.mkdir(parents=True, exist_ok=True)
    nodes = {}
    for rank in (1, 0):
        with open(logs / f"node{rank}.log", "w") as out:
            nodes[rank] = subprocess.Popen(
                ["bash", "scripts/train.sh", str(TINY), *args, *(node_args or {}).get(rank, [])],
                cwd=REPO,
                env={**env, "NODE_RANK": str(rank), "REGION": regions[rank]},
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
    codes = {rank: node.wait(timeout=300) for rank, node in nodes.items()}
    return {rank: (codes[rank], (logs / f"node{rank}.log").read_text()) for rank in (0, 1)}


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r"(\[rank\d\]:)?error: ", line)]


@pytest.fixture(scope="module")
def loopback_run(tmp_path_factory) -> tuple[dict[int, tuple[int, str]], Path]:
    """Two torchrun "nodes" on loopback, one pipeline stage each, 4 steps of ``tests/tiny.toml``,
    the node with NODE_RANK=1 started first, logging to an offline wandb run: each node's
    (exit code, output) and the dump folder."""
    tmp_path = tmp_path_factory.mktemp("loopback")
    dump = tmp_path / "run"
    args = ["--dump_folder", str(dump), "--training.steps", "4", "--metrics.enable_wandb",
            "--metrics.wandb_project", "pm-two-nodes", "--metrics.wandb_tags", '["ci", "two-nodes"]']  # fmt: skip
    nodes = _two_nodes(tmp_path, args, {0: "west", 1: "east"}, env={"WANDB_MODE": "offline"})
    assert [nodes[r][0] for r in (0, 1)] == [0, 0], nodes[0][1][-3000:] + nodes[1][1][-3000:]
    return nodes, dump


def test_two_nodes_train_in_node_rank_order_and_log_to_offline_wandb(loopback_run):
    """Two torchrun "nodes", one pipeline stage each, the same config, the node with NODE_RANK=1
    started first: each node gets the global rank and stage its NODE_RANK says, they train, and
    the wire metrics reach an offline wandb run."""
    nodes, dump = loopback_run
    host = socket.gethostname()
    for rank, region in ((0, "west"), (1, "east")):
        output = nodes[rank][1]
        assert (
            f"[rank{rank}]:" in output
            and f"rank {rank}/2 on node {rank} (host {host}, REGION={region}) holds pipeline "
            f"stage {rank} of 2"
            in output
        ), output[-3000:]
    assert (
        "placement: stage 0: ranks 0 on node(s) 0 (region west); "
        "stage 1: ranks 1 on node(s) 1 (region east)" in nodes[0][1]
    )

    records = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["wire/compression_ratio"] == 16.0

    (run_file,) = Path(dump, "wandb").rglob("run-*.wandb")
    dump_text = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "beta", "leet", "inspect", str(run_file)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert 'project:  "pm-two-nodes"' in dump_text
    assert 'tags:  "ci"' in dump_text and 'tags:  "two-nodes"' in dump_text
    logged = dict(re.findall(r'nested_key:\s+"([^"]+)"\s+value_json:\s+"([^"]*)"', dump_text))
    for key in (
        "wire/fwd_bytes",
        "wire/bwd_bytes",
        "wire/compression_ratio",
        "wire/fwd_bytes/b0",
        "subspace/leak",
    ):
        assert key in logged, key
    assert float(logged["wire/compression_ratio"]) == 16.0


def test_data_parallel_group_across_regions_is_refused_at_startup(tmp_path):
    """Two nodes of one GPU each in regions a and b, no pipeline and 2-way data parallelism: the
    only data-parallel group spans both regions, so both nodes stop before step 1 with exit code
    2 and one error line naming the regions."""
    args = ["--dump_folder", str(tmp_path / "run"), "--parallelism.pipeline_parallel_degree", "1",
            "--parallelism.data_parallel_replicate_degree", "2"]  # fmt: skip
    nodes = _two_nodes(tmp_path, args, {0: "a", 1: "b"})
    for code, output in nodes.values():
        assert code == 2, output[-3000:]
        errors = _errors(output)
        assert len(errors) == 1, errors
        assert (
            "data-parallel group of pipeline stage 0 spans regions 'a' (ranks 0), 'b' (ranks 1)"
            in errors[0]
        )
        assert "Traceback" not in output and "step:  1" not in output


def test_per_node_checkpoints_resume_without_a_shared_filesystem(tmp_path):
    """Two nodes, each with its own dump folder (no shared disk). In TorchTitan's layout (one
    checkpoint, ``.metadata`` on rank 0 only) the run stops at start-up on both nodes with one
    line, instead of node 1 starting over at step 0 on the first resume. With ``[checkpoint]
    per_node`` each node writes its own; after node 0 lost its step-4 checkpoint, both resume at
    step 3 from step 2, the latest both have, every loss equal to the uninterrupted run's; the
    node folders, copied into one checkpoint folder, export; a node whose disk lost every
    checkpoint stops the relaunch with one line naming what each node sees."""
    regions = {0: "west", 1: "east"}
    args = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"]

    def launch(name, *extra):
        dumps = {r: tmp_path / name / f"node{r}" for r in (0, 1)}
        nodes = _two_nodes(tmp_path / name, [*args, *extra], regions,
                           node_args={r: ["--dump_folder", str(dumps[r])] for r in (0, 1)})  # fmt: skip
        return dumps, nodes

    def refusal(nodes) -> list[str]:
        """Each node's one error line (both nodes stop, no traceback)."""
        lines = []
        for code, output in nodes.values():
            assert code == 2 and "Traceback" not in output, output[-3000:]
            (line,) = _errors(output)
            lines.append(line)
        return lines

    _, shared = launch("shared")
    for line in refusal(shared):
        assert "is not one folder every node sees (node 0 sees the files of node(s) [0]; " \
            "node 1 sees the files of node(s) [1])" in line, line
        assert "[checkpoint] per_node = true" in line, line

    dumps, reference = launch("per_node", "--checkpoint.per_node", "true")
    assert [reference[r][0] for r in (0, 1)] == [0, 0], reference[1][1][-3000:]
    folders = {r: dumps[r] / "checkpoint" / f"node-{r}-of-2" for r in (0, 1)}
    for r in (0, 1):
        assert sorted(p.name for p in folders[r].iterdir()) == ["step-2", "step-4"]
        assert not (dumps[1 - r] / "checkpoint" / f"node-{r}-of-2").exists()
    (metrics,) = [d / "metrics.jsonl" for d in dumps.values() if (d / "metrics.jsonl").exists()]
    uninterrupted = {r["step"]: r["loss"] for r in read_jsonl(metrics)}
    shutil.rmtree(folders[0] / "step-4")
    metrics.unlink()
    _, resumed = launch("per_node", "--checkpoint.per_node", "true")
    for code, output in resumed.values():
        assert code == 0 and "Training starts at step 3" in output, output[-3000:]
    assert "step 4 is not complete on every rank; resuming from step 2" in resumed[0][1]
    assert {r["step"]: r["loss"] for r in read_jsonl(metrics)} == {
        s: uninterrupted[s] for s in (3, 4)
    }

    gathered = tmp_path / "gathered"
    shutil.copytree(dumps[0] / "checkpoint", gathered)

    def export(folder, out):
        return subprocess.run(
            [sys.executable, "-m", "protocol_models.export", "--checkpoint", str(folder),
             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    alone = export(gathered, tmp_path / "hf_alone")
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
    assert "without the folder of node(s) [1]" in alone.stderr, alone.stderr
    shutil.copytree(folders[1], gathered / "node-1-of-2")
    done = export(gathered, tmp_path / "hf")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "node-*/step-4" in done.stdout and (tmp_path / "hf" / "config.json").is_file()

    shutil.rmtree(folders[1])  # node 1's disk replaced
    _, lost = launch("per_node", "--checkpoint.per_node", "true")
    for line in refusal(lost):
        assert "a resume: the ranks do not see the same checkpoints" in line, line
        assert "(node 0 sees steps [2, 4]; node 1 sees none)" in line, line


@pytest.fixture
def object_store(tmp_path):
    """A real S3-compatible server (moto's, on a free localhost port) with one empty bucket;
    yields the environment every node's S3 client reads (endpoint and keys)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update(env)  # this process's client too (restored below)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("run-bucket")
        yield env
    finally:
        for key in env:
            os.environ.pop(key, None)
        server.terminate()
        server.wait(timeout=30)


def test_checkpoints_in_an_object_store_survive_a_lost_node(tmp_path, object_store):
    """``[checkpoint] folder`` an s3:// URL on a real S3-compatible server: two nodes with
    their own dump folders write one checkpoint there and nothing on their disks. The run
    crashes after step 3 (its step-4 checkpoint never completed) and node 1 is replaced by a
    machine with an empty disk: the relaunch resumes both nodes at step 3 from step 2, every
    loss equal to the uninterrupted run's. A bucket that does not exist stops the launch with
    one line, before any worker."""
    import s3fs

    store = s3fs.S3FileSystem()
    regions = {0: "west", 1: "east"}
    args = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4",
            "--checkpoint.folder", "s3://run-bucket/tiny"]  # fmt: skip
    dumps = {r: tmp_path / f"node{r}" for r in (0, 1)}

    def launch():
        return _two_nodes(tmp_path / "logs", args, regions, env=object_store,
                          node_args={r: ["--dump_folder", str(dumps[r])] for r in (0, 1)})  # fmt: skip

    first = launch()
    assert [first[r][0] for r in (0, 1)] == [0, 0], first[1][1][-3000:]
    assert sorted(p.rsplit("/", 1)[1] for p in store.ls("run-bucket/tiny")) == [
        "run.json", "step-2", "step-4"]  # fmt: skip
    for dump in dumps.values():
        assert not (dump / "checkpoint").exists() and not list(dump.glob("s3*"))
    (metrics,) = [d / "metrics.jsonl" for d in dumps.values() if (d / "metrics.jsonl").exists()]
    uninterrupted = {r["step"]: r["loss"] for r in read_jsonl(metrics)}
    store.rm("run-bucket/tiny/step-4", recursive=True)  # the crash: step 4 was never saved
    metrics.unlink()
    shutil.rmtree(dumps[1])  # node 1: a fresh machine, an empty disk
    resumed = launch()
    for code, output in resumed.values():
        assert code == 0 and "Training starts at step 3" in output, output[-3000:]
    assert {r["step"]: r["loss"] for r in read_jsonl(metrics)} == {
        s: uninterrupted[s] for s in (3, 4)
    }

    missing = subprocess.run(
        ["bash", "scripts/train.sh", str(TINY), "--checkpoint.enable", "--checkpoint.folder",
         "s3://no-such-bucket/run", "--dump_folder", str(tmp_path / "missing")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **object_store},
    )  # fmt: skip
    assert missing.returncode == 2, missing.stdout[-2000:] + missing.stderr[-2000:]
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("error: checkpoint.folder = 's3://no-such-bucket/run': writing a "
                           "probe object there failed"), line  # fmt: skip
    assert "AWS_ENDPOINT_URL" in line and not (tmp_path / "missing").exists()


def _netns_ready() -> str | None:
    """Why the overlay test cannot run here (None: it can): it needs root, ``ip netns``, a TUN
    device and WireGuard's tools (``.ci/run`` installs them and sets ``PM_REQUIRE_NETNS=1``)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [t for t in ("ip", "wg", "wg-quick", "wireguard-go") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt install iproute2 wireguard-tools wireguard-go)"
    return None if os.path.exists("/dev/net/tun") else "needs /dev/net/tun"


def test_two_nodes_train_over_a_wireguard_overlay_and_refuse_public_addresses(
    tmp_path, loopback_run
):
    """The documented network step for real: ``protocol_models.overlay`` writes the nodes'
    WireGuard configs, ``wg-quick up`` joins two network namespaces over a shaped link (the
    project's TUN relay, 200 Mbit/s + 2 ms), and ``scripts/train.sh`` on overlay addresses
    trains to the losses of the same two nodes on loopback, its traffic through the tunnel. A
    rendezvous on a public address is refused in one line before any worker, unless
    ``PM_ALLOW_PUBLIC_NETWORK=1``. (The loopback run logs to an offline wandb run as well, which
    changes no loss.)"""
    from recipes.common.tun_relay import ADDRESSES, Shape, in_namespace, link_namespaces

    public = {**os.environ, "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "1.1.1.1"}
    refused = subprocess.run(["bash", "scripts/train.sh", str(TINY), "--dump_folder",
                              str(tmp_path / "public")], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env=public)  # fmt: skip
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: MASTER_ADDR = 1.1.1.1 is a public address (1.1.1.1) and "
                           "hosts the rendezvous store"), line  # fmt: skip
    assert "PM_ALLOW_PUBLIC_NETWORK=1" in line and not (tmp_path / "public").exists()
    allowed = subprocess.run([sys.executable, "-m", "protocol_models.config", "--toml", str(TINY)],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={**public, "PM_ALLOW_PUBLIC_NETWORK": "1"})  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr

    problem = _netns_ready()
    if problem:
        assert os.environ.get("PM_REQUIRE_NETNS") != "1", problem
        pytest.skip(problem)
    args = ["--training.steps", "4"]
    expected = [(r["step"], r["loss"]) for r in read_jsonl(loopback_run[1] / "metrics.jsonl")]

    nodes_file = tmp_path / "nodes.txt"
    nodes_file.write_text(f"# node 0 hosts the store\n{ADDRESSES[0]}\n{ADDRESSES[1]}:51820\n")
    out = tmp_path / "overlay"
    made = subprocess.run([sys.executable, "-m", "protocol_models.overlay", str(nodes_file),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "MASTER_ADDR=10.77.0.1 GLOO_SOCKET_IFNAME=wgpm NCCL_SOCKET_IFNAME=wgpm" in made.stdout
    # One machine's namespaces share /var/run/wireguard, where a user-space interface keeps its
    # control socket, so node 1's interface gets another name here (on real nodes both are wgpm).
    configs = [out / "node-0" / "wgpm.conf", out / "node-1" / "wgpm1.conf"]
    (out / "node-1" / "wgpm.conf").rename(configs[1])
    assert oct(configs[0].stat().st_mode & 0o777) == "0o600"
    with link_namespaces(Shape(200.0, 2.0)):
        for node, config in enumerate(configs):
            up = subprocess.run(in_namespace(node, ["wg-quick", "up", str(config)]),
                                capture_output=True, text=True, timeout=60)  # fmt: skip
            assert up.returncode == 0, up.stderr
        try:
            dump = tmp_path / "overlay_run"
            procs = []
            for node, config in enumerate(configs):
                env = {"NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "10.77.0.1",
                       "MASTER_PORT": "29500", "NGPU": "1", "REGION": ["west", "east"][node],
                       "GLOO_SOCKET_IFNAME": config.stem}  # fmt: skip
                cmd = in_namespace(node, ["env", *(f"{k}={v}" for k, v in env.items()), "bash",
                                          "scripts/train.sh", str(TINY), *args, "--dump_folder",
                                          str(dump)])  # fmt: skip
                log = open(tmp_path / f"overlay_node{node}.log", "w")  # noqa: SIM115
                procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
            codes = [p.wait(timeout=300) for p in procs]
            logs = [(tmp_path / f"overlay_node{n}.log").read_text() for n in (0, 1)]
            assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
            transfer = subprocess.run(in_namespace(0, ["wg", "show", "wgpm", "transfer"]),
                                      capture_output=True, text=True, check=True).stdout.split()
        finally:
            for node, config in enumerate(configs):
                subprocess.run(in_namespace(node, ["wg-quick", "down", str(config)]),
                               capture_output=True, timeout=60)  # fmt: skip
    records = read_jsonl(dump / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == expected
    # node 0's tunnel carried at least its stage's boundary messages, each way (plus the
    # stores' and the collectives' traffic, and WireGuard's own overhead)
    received, sent = int(transfer[1]), int(transfer[2])
    assert sent >= sum(r["wire/fwd_bytes"] for r in records) > 0, transfer
    assert received >= sum(r["wire/bwd_bytes"] for r in records) > 0, transfer


def test_placement_check_and_summary():
    """The pure part of the start-up check: 2 stages of 4 ranks on 4 nodes of 2 GPUs."""

    def place(region, node, stage, labelled=True):
        return RankPlace(region=region, labelled=labelled, host=f"h{node}", node=node, stage=stage)

    good = [place("us" if rank < 4 else "eu", rank // 2, rank // 4) for rank in range(8)]
    assert placement_problem(good) is None
    assert describe_placement(good) == (
        "stage 0: ranks 0-3 on node(s) 0-1 (region us); stage 1: ranks 4-7 on node(s) 2-3 (region eu)"
    )
    # nodes 1 and 2 swapped (NODE_RANK not given region by region): both stages span us and eu
    swapped = [good[i] for i in (0, 1, 4, 5, 2, 3, 6, 7)]
    swapped = [p._replace(stage=rank // 4, node=rank // 2) for rank, p in enumerate(swapped)]
    problem = placement_problem(swapped)
    assert problem.startswith(
        "the data-parallel group of pipeline stage 0 spans regions 'us' (ranks 0-1), 'eu' (ranks 2-3)"
    )
    assert "REGION" not in problem.split("or change [parallelism]")[1]
    # without REGION a node's label is its host name: 2 nodes per stage are 2 regions
    unlabelled = [place(f"h{n // 2}", n // 2, n // 4, labelled=False) for n in range(8)]
    assert placement_problem(unlabelled).endswith(
        "set REGION on every node (unset, a node's region is its host name)"
    )
    assert interleaved_regions(good) is None and interleaved_regions(unlabelled) is None
    # four 1-GPU nodes in regions a, b, a, b: three boundaries cross a slow link, one would
    turns = [place("ab"[n % 2], n, n) for n in range(4)]
    assert placement_problem(turns) is None
    assert interleaved_regions(turns) == (
        "the pipeline's stages take turns between regions (a, b, a, b): 3 boundaries cross a "
        "slow link where 1 would; number the nodes (NODE_RANK) region by region so that each "
        "region holds consecutive stages"
    )


def test_slurm_nodes_are_numbered_in_the_order_given(tmp_path):
    """``scripts/slurm/*.sbatch`` with stand-ins for ``scontrol``, ``srun`` (one task per node)
    and the Python that ``scripts/train.sh`` runs (the config check, then the launcher, whose
    arguments it prints): NODE_RANK follows the NODES file (else SLURM_HOSTFILE, else the sorted
    node names), the rendezvous is the first node, REGION comes from the file, never from the
    submitting shell."""
    bin_dir = fake_commands(tmp_path / "bin", {
        "scontrol": 'tr , "\\n" <<<"$3"',  # scontrol show hostnames n1,n2,...
        "srun": 'while [[ $1 == --* ]]; do shift; done\n'
        'for h in ${SLURM_JOB_NODELIST//,/ }; do SLURMD_NODENAME=$h "$@" || exit; done',
        "python": 'if [ "$2" = protocol_models.config ]; then printf "nproc=4\\ndevice=cuda\\n"; exit; fi\n'
        'echo "$SLURMD_NODENAME REGION=${REGION-unset}: $*"',
    })  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_NODELIST": "n1,n2,n3,n4", "SLURM_NNODES": "4", "SLURM_SUBMIT_DIR": str(REPO),
           "REGION": "from-the-submitting-shell"}  # fmt: skip

    def sbatch(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "scripts/slurm/llama3_2b_l4.sbatch", "--training.steps", "5"],
            cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def launches(result: subprocess.CompletedProcess) -> dict[str, tuple[str, str]]:
        """host -> (REGION, the launcher's arguments from --nnodes on)"""
        assert result.returncode == 0, result.stdout + result.stderr
        found = re.findall(
            r"^(n\d) REGION=(\S+): -m protocol_models.launch (.*)$", result.stdout, re.M
        )
        return {host: (region, args) for host, region, args in found}

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("# pipeline order\nn3 us-east\nn1 us-east\n\nn4 eu-west\nn2 eu-west\n")
    got = launches(sbatch(NODES=str(nodes)))
    for rank, (host, region) in enumerate(
        [("n3", "us-east"), ("n1", "us-east"), ("n4", "eu-west"), ("n2", "eu-west")]
    ):
        assert got[host][0] == region
        assert got[host][1].startswith(
            f"--nnodes 4 --node_rank {rank} --rdzv_backend c10d --rdzv_endpoint n3:29500 "
            + ("--local-addr n3 " if rank == 0 else "")  # node 0 announces the workers' store
            + "--nproc_per_node 1 "
        )
        config = REPO / "configs" / "llama3_2b_protocol.toml"
        assert got[host][1].endswith(f"--toml {config} --training.steps 5")

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n2\nn2\nn4\nn1\nn3\n")  # one line per task, as SLURM reads it
    got = launches(sbatch(SLURM_HOSTFILE=str(hostfile)))
    assert [got[h][1].split()[3] for h in ("n2", "n4", "n1", "n3")] == ["0", "1", "2", "3"]
    assert {region for region, _ in got.values()} == {"unset"}

    got = launches(sbatch())
    assert [got[h][1].split()[3] for h in ("n1", "n2", "n3", "n4")] == ["0", "1", "2", "3"]

    nodes.write_text("n3\nn1\nn4\n")
    result = sbatch(NODES=str(nodes))
    assert result.returncode == 2 and "protocol_models.launch" not in result.stdout
    assert result.stderr.strip() == (
        f"error: the node order (NODES={nodes}) lists [n3 n1 n4] but the job has [n1 n2 n3 n4]; "
        "list every allocated node once"
    )


def test_every_multinode_launch_reads_the_nccl_settings_file(tmp_path):
    """``scripts/train.sh`` with NNODES > 1 (a launch without SLURM, node by node) exports the
    NCCL/TCP settings of ``scripts/multinode.env``, which the SLURM script reads too; a value
    exported before the launch wins; a single-node launch sets none."""
    names = ["NCCL_NET", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_NTHREADS",
             "NCCL_NSOCKS_PERTHREAD", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]  # fmt: skip
    shown = " ".join(f"{n}=${{{n}-unset}}" for n in names)
    bin_dir = fake_commands(tmp_path / "bin", {
        "python": 'if [ "$2" = protocol_models.config ]; then printf "nproc=2\\ndevice=cuda\\n"; exit; fi\n'
        f'echo "{shown}"',
    })  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update(PYTHON=str(bin_dir / "python"), MASTER_ADDR="10.0.0.1", NODE_RANK="1")

    def launch(**extra: str) -> dict[str, str]:
        result = subprocess.run(["bash", "scripts/train.sh", str(TINY)], cwd=REPO,
                                env={**env, **extra}, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return dict(item.split("=", 1) for item in result.stdout.split())

    assert launch(NNODES="2") == {"NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1",
                                  "NCCL_SOCKET_IFNAME": "^lo,docker",
                                  "NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "1",
                                  "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}  # fmt: skip
    assert launch(NNODES="2", NCCL_SOCKET_IFNAME="wg0")["NCCL_SOCKET_IFNAME"] == "wg0"
    assert set(launch(NNODES="1").values()) == {"unset"}
    assert "source scripts/multinode.env" in (REPO / "scripts/slurm/train_nodes.sh").read_text()


def test_overlay_endpoints_are_parsed_as_wireguard_writes_them():
    """A nodes file's host, host:port, bare IPv6 address or [IPv6]:port becomes WireGuard's
    endpoint (port 51820 where none is given); a port that is not 1-65535 is one line."""
    from protocol_models.cluster.overlay import endpoint
    from protocol_models.tools.errors import UserError

    assert [endpoint(h) for h in ("203.0.113.7", "node.example:51000", "2001:db8::1",
                                  "[2001:db8::2]", "[2001:db8::2]:5000")] == [
        "203.0.113.7:51820", "node.example:51000", "[2001:db8::1]:51820",
        "[2001:db8::2]:51820", "[2001:db8::2]:5000"]  # fmt: skip
    for bad in ("node:abc", "node:0", "node:70000", "[2001:db8::2]x"):
        with pytest.raises(UserError, match="is not host, host:port"):
            endpoint(bad)
