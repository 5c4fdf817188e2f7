"""The process and thread executors open no network socket: not in the caller, not in any worker."""

import multiprocessing
import os

import psutil
import torch
from models import classification_stream, mlp
from torch import nn

import partime


def inet_sockets(pid):
    return psutil.Process(pid).net_connections(kind="inet")  # TCP and UDP, IPv4 and IPv6, listening or not


def test_a_running_process_pipeline_holds_no_inet_socket():
    xs, ys = classification_stream(30)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)
    with partime.Pipeline(mlp(), [2, 3, 2], loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, threads=1) as pipe:
        for x, y in zip(xs[:15], ys[:15]):
            pipe.step(x, y)
        family = [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]
        stages = [p for p in multiprocessing.active_children() if p.name.startswith("partime-stage-")]
        assert len(stages) == 2 and {p.pid for p in stages} <= set(family)  # the caller runs the last stage
        found = {pid: inet_sockets(pid) for pid in family}
        pipe.flush()
    assert found == {pid: [] for pid in family}


def test_a_running_thread_pipeline_holds_no_inet_socket_and_starts_no_process():
    xs, ys = classification_stream(30)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, threads=1)
    with partime.Pipeline(mlp(), [2, 3, 2], executor="thread", **kw) as pipe:
        for x, y in zip(xs[:15], ys[:15]):
            pipe.step(x, y)
        started = {p.pid for p in psutil.Process().children(recursive=True)} - before
        found = inet_sockets(os.getpid())
        pipe.flush()
    assert started == set() and found == []
