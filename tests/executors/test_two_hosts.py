"""The distributed guide's two-host commands, run as written between two hosts: two Linux network namespaces
joined by a veth pair, each with an address of its own.

Host A runs the guide's rank-0 command, host B its rank-1 command (HOST_A being host A's
address), each under ``ip netns exec`` with ``GLOO_SOCKET_IFNAME`` set to the host's end of the
pair. What rank 0 saved is compared with the inline executor on the same stream; and when a rank
is killed on host B, host A's rank must report it within two seconds, and its torchrun then exit
with an error. Each namespace has ports of its own, so the guide's port 29500 is free whatever
else runs on this machine.

Needs root and iproute2's ``ip`` (skipped otherwise). Every process started in the hosts is
killed, and the namespaces and the veth pair removed, also when a test fails.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

import partime

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "distributed.md"
EXAMPLE = ROOT / "examples" / "distributed_stream.py"
SAMPLES = 60
STOP_S = 2.0  # the guide: a rank that dies stops every rank within two seconds
# Then the worker and torchrun exit, each an interpreter that imported torch: about 0.5 s each here
# when idle, more when the machine is busy; the bound test_distributed puts on the ranks' exits.
EXIT_S = 5.0


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str  # its end of the veth pair
    address: str


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)


def pids_in(host: Host) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", host.netns).stdout.split()]


def kill_all_in(host: Host) -> None:
    """Kill every process in ``host`` (only this test's processes run there) and wait till they go."""
    for _ in range(50):
        pids = pids_in(host)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


@pytest.fixture
def hosts():
    """Hosts A (10.211.0.1) and B (10.211.0.2), joined by a veth pair; removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip command")
    if os.geteuid() != 0:
        pytest.skip(f"needs root to make network namespaces (running as uid {os.geteuid()})")
    tag = os.getpid()  # names of their own, so that runs of this test at the same time do not meet
    a = Host(f"partime-a-{tag}", f"pta{tag}", "10.211.0.1")
    b = Host(f"partime-b-{tag}", f"ptb{tag}", "10.211.0.2")
    made = []
    try:
        for host in (a, b):
            done = ip("netns", "add", host.netns)
            if done.returncode != 0:
                pytest.skip(f"ip netns add {host.netns} failed: {done.stderr.strip()}")
            made.append(host)
        steps = [
            ("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname, "netns", b.netns)
        ]
        for host in (a, b):
            steps += [
                ("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname),
                ("-n", host.netns, "link", "set", host.ifname, "up"),
                ("-n", host.netns, "link", "set", "lo", "up"),
            ]
        steps += [("netns", "exec", host.netns, "true") for host in (a, b)]  # it can run commands there
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"ip {shlex.join(step)} failed: {done.stderr.strip()}")
        yield a, b
    finally:
        for host in made:
            kill_all_in(host)
            ip("netns", "delete", host.netns)  # the veth pair goes with its namespaces


def readme_commands(host_a: str) -> list[list[str]]:
    """The distributed guide's two-host commands, host A's (rank 0) first, with HOST_A set to ``host_a``."""
    found = re.findall(r"^host ([AB])\$ (torchrun .*)$", GUIDE.read_text(), re.MULTILINE)
    assert [host for host, _ in found] == ["A", "B"], found
    return [[arg.replace("HOST_A", host_a) for arg in shlex.split(command)] for _, command in found]


def start(hosts: tuple[Host, Host], out: Path, *options: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """Run the guide's command in each host, with ``options`` for the example; their logs."""
    procs, logs = [], []
    for host, command in zip(hosts, readme_commands(hosts[0].address), strict=True):
        env = dict(
            os.environ,
            GLOO_SOCKET_IFNAME=host.ifname,
            PYTHONUNBUFFERED="1",
            PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        )
        logs.append(out / f"{host.netns}.log")
        with open(logs[-1], "w") as log:
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", host.netns, *command, *options],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs, logs


def stop(procs: list[subprocess.Popen], hosts: tuple[Host, Host]) -> None:
    """Kill whatever still runs, torchrun and its workers, and reap the launchers."""
    for host in hosts:
        kill_all_in(host)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def read(logs: list[Path]) -> str:
    return "\n\n".join(f"{log.name}:\n{log.read_text()}" for log in logs)


def example():
    spec = importlib.util.spec_from_file_location("distributed_stream", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_two_host_commands_learn_what_the_inline_executor_learns(hosts, tmp_path):
    weights, record = tmp_path / "trained.pt", tmp_path / "record.json"
    procs, logs = start(hosts, tmp_path, "--samples", str(SAMPLES), "--save", str(weights), "--record", str(record))
    try:
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop(procs, hosts)
    assert [proc.returncode for proc in procs] == [0, 0], read(logs)
    seen = json.loads(record.read_text())
    assert len(seen["balance"]) == 2 and sum(seen["balance"]) == 7, seen["balance"]  # cut by timing, on rank 0
    assert f"{SAMPLES} samples" in logs[0].read_text()

    stream = example()
    xs, ys = zip(*stream.frames(SAMPLES), strict=True)
    with partime.Pipeline(
        stream.conv_net(), seen["balance"], executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=stream.optimizer
    ) as pipe:
        results = list(pipe.stream(xs, ys))
        expected = pipe.module.state_dict()
    assert seen["indices"] == [r.index for r in results] == list(range(SAMPLES))
    for i, (loss, r) in enumerate(zip(seen["losses"], results, strict=True)):
        assert loss == r.loss, i
    trained = torch.load(weights)
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(trained[name], value), name
    assert not torch.equal(trained["0.0.weight"], stream.conv_net().state_dict()["0.0.weight"])  # it learnt


def worker_of(torchrun: subprocess.Popen) -> psutil.Process:
    """The example's process that ``torchrun`` (started through ``ip netns exec``) runs."""
    family = psutil.Process(torchrun.pid).children(recursive=True)
    workers = [
        p
        for p in family
        if str(EXAMPLE.relative_to(ROOT)) in p.cmdline() and not any(arg.endswith("torchrun") for arg in p.cmdline())
    ]
    assert len(workers) == 1, [p.cmdline() for p in family]
    return workers[0]


def test_a_rank_killed_on_host_b_fails_host_a_within_two_seconds_naming_its_stage(hosts, tmp_path):
    procs, logs = start(hosts, tmp_path, "--samples", "1000000")
    try:
        deadline = time.monotonic() + 60
        while "sample 100:" not in logs[0].read_text():  # both stages are running
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), read(logs)
            time.sleep(0.05)
        worker_of(procs[1]).send_signal(signal.SIGKILL)
        killed, failed = time.monotonic(), None
        while time.monotonic() - killed < EXIT_S:
            running = procs[0].poll() is None
            if failed is None and "WorkerDiedError" in logs[0].read_text():
                failed = time.monotonic() - killed
            if not running:
                break
            time.sleep(0.01)
        exited = time.monotonic() - killed
        print(
            f"after rank 1 was killed: host A's error in {failed and round(failed, 2)} s, "
            f"its torchrun gone in {exited:.2f} s"
        )
    finally:
        stop(procs, hosts)
    log = logs[0].read_text()
    assert failed is not None and failed < STOP_S, (failed, log)
    assert exited < EXIT_S and procs[0].returncode != 0, (exited, log)
    assert "partime.errors.WorkerDiedError: stage 1, " in log, log
    assert "rank 1 is gone: rank 0 on " in log, log
