"""Rank 0 of a tensor-parallel engine starts its follower ranks and joins their group (issue #28).

Each follower is a process of its own (`python -m morion.engine.rank_follower`), started with
`subprocess` rather than `multiprocessing` so that an engine that is itself a daemonic process (the
server's engine process) can start it. Its standard input carries, first, what it needs to join
(`FollowerStart`), then rank 0's device work (parallel/step_mirror.py). The ranks meet through a TCPStore
that rank 0 opens on a free port of the loopback interface; the model's collectives run over NCCL on CUDA
(rank r on device index r) and over gloo on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from morion.config import EngineConfig
from morion.errors import MorionError
from morion.parallel.group import TensorParallel
from morion.parallel.step_mirror import StepMirror

_FOLLOWER_EXIT_S = 30.0  # how long `close` waits for a follower to exit before killing it


class FollowerStart(NamedTuple):
    config: EngineConfig  # the follower's own: `device` is its rank's
    rank: int
    size: int
    store_port: int


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` as rank `rank` builds from: on CUDA, the device `rank` places after the configured one
    (cuda and auto: cuda:0 for rank 0); the CPU is every rank's."""
    device = config.torch_device
    if device.type != "cuda":
        return dataclasses.replace(config, device="cpu")
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + rank}")


def share_cpu_threads(config: EngineConfig) -> int:
    """On the CPU every rank computes at once: each takes its share of the cores for torch's threads (two
    ranks of all cores each ran 20x slower than one rank on a 2-core machine). Returns the previous count."""
    previous = torch.get_num_threads()
    if config.torch_device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size))
    return previous


class Ranks:
    """Rank 0's view of the group: the model's `TensorParallel`, the mirror its followers repeat its
    device work from, and the follower processes, stopped by `close`."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        if dist.is_initialized():  # torch.distributed has one default group a process
            raise MorionError("a process runs one tensor-parallel engine at a time: close the other first")
        device = torch.device(rank_config(config, 0).device)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
            raise MorionError(
                f"--tensor-parallel-size {size} needs {size} CUDA devices from {device}; "
                f"{torch.cuda.device_count()} are visible"
            )
        self._threads = share_cpu_threads(config)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        self.processes: list[subprocess.Popen] = []
        try:
            self._start(config, store, device)
        except BaseException:
            for process in self.processes:  # a follower that started, or never joined
                process.kill()
                process.wait()
            torch.set_num_threads(self._threads)
            raise
        self._store = store  # the group's rendezvous: kept for the group's life

    def _start(self, config: EngineConfig, store: dist.TCPStore, device: torch.device) -> None:
        size = config.tensor_parallel_size
        for rank in range(1, size):
            process = subprocess.Popen(
                [sys.executable, "-m", "morion.engine.rank_follower"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,  # stdout is the user's (generated text); errors go to stderr
            )
            start = FollowerStart(rank_config(config, rank), rank, size, store.port)
            pickle.dump(start, process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            process.stdin.flush()
            self.processes.append(process)
        self.tensor_parallel = TensorParallel.join(0, size, device, store=store)
        self.mirror = StepMirror([process.stdin for process in self.processes], self.tensor_parallel)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def close(self) -> None:
        """Stops the followers (the stop message, then a kill for one that does not exit) and leaves the
        group. Idempotent."""
        self.mirror.stop()
        for process in self.processes:
            try:
                process.wait(_FOLLOWER_EXIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        self.tensor_parallel.leave()
        self._store = None  # the rendezvous server's thread ends here, not in interpreter teardown
        torch.set_num_threads(self._threads)
