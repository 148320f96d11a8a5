"""Several processes on one calibration: `torchrun --nproc-per-node N $(which quantkit) quantize RECIPE`, or
`quantkit quantize --nproc N`, which launches the same.

Data-parallel calibration, weight-parallel solves (the scheme of llm-compressor's distributed oneshot):
  - every rank runs every block's forward on a disjoint share of the calibration windows (rank r: r, r+N, ...);
  - a Hessian is all-reduced (sum and token count) where a single process would use it, right before the solve;
  - each Linear's solve belongs to one rank, balanced by cost (out x in^2) within the group of Linears that read one
    input (q/k/v, gate/up), so a group's members are solved in parallel; the owner broadcasts the quantized weight
    and every rank swaps it in before the block's forward goes on;
  - rank 0 writes the checkpoints' block states and the artifacts; every rank keeps its own share of hidden states.
A rank that fails writes its one-line error where the others look when a collective breaks, so every rank ends
with that line; a rank killed outright is found by its pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuantkitError, first_line

FOLDER = ".quantkit-ranks"  # under export.output: each rank's pid, and the error of a rank that failed
PEER_GRACE_POLLS = 30  # x 0.1 s: how long a failed collective waits to see which peer died


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    folder: Path | None = None  # where ranks leave their pid and a failing rank its error

    @property
    def active(self) -> bool:
        return self.world > 1

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[self.rank :: self.world] if self.active else tokens

    def windows(self, total: int) -> torch.Tensor:
        """The indices, among all `total` calibration windows, of this rank's share (in its order)."""
        return torch.arange(self.rank, total, self.world)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """t summed (op "sum") or maximised ("max") over the ranks, in place."""
        if self.active:
            reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
            # NCCL reduces GPU tensors only: a host tensor (a token count) makes the round trip
            buf = t.cuda() if t.device.type == "cpu" and torch.distributed.get_backend() == "nccl" else t
            self._collective(lambda: torch.distributed.all_reduce(buf, op=reduce_op))
            if buf is not t:
                t.copy_(buf)
        return t

    def all_gather(self, obj) -> list:
        """Every rank's obj (any picklable object), in rank order."""
        if not self.active:
            return [obj]
        box = [None] * self.world
        self._collective(lambda: torch.distributed.all_gather_object(box, obj))
        return box

    def barrier(self) -> None:
        if self.active:
            self._collective(torch.distributed.barrier)

    def broadcast(self, obj, src: int):
        """obj from rank src (any picklable object: a QuantizedWeight with its tensors) to every rank."""
        if not self.active:
            return obj
        box = [obj]
        self._collective(lambda: torch.distributed.broadcast_object_list(box, src=src))
        return box[0]

    def owners(self, costs: dict[str, int]) -> dict[str, int]:
        """One rank per name, the costliest first onto the least-loaded rank (ties: lowest rank). Deterministic, so
        every rank computes the same answer without talking."""
        load = [0] * self.world
        out = {}
        for name in sorted(costs, key=lambda n: (-costs[n], n)):
            r = min(range(self.world), key=lambda i: (load[i], i))
            out[name] = r
            load[r] += costs[name]
        return out

    # -- failures --
    def _collective(self, fn) -> None:
        try:
            fn()
        except RuntimeError as err:  # a peer died or failed: gloo / NCCL report a closed connection or a timeout
            raise QuantkitError(self.peer_failure(err)) from None

    def peer_failure(self, err: Exception) -> str:
        """Why a collective failed: a peer's recorded error, or a peer that died. A peer killed by a signal can break
        the connection a moment before its process is reaped, so its absence is polled for a short while."""
        if self.folder is not None:
            for _ in range(PEER_GRACE_POLLS):
                for r in range(self.world):
                    msg = self.folder / f"rank-{r}.error"
                    if r != self.rank and msg.is_file():
                        return msg.read_text().strip()
                for r in range(self.world):
                    pid = self.folder / f"rank-{r}.pid"
                    if r != self.rank and pid.is_file() and not alive(int(pid.read_text())):
                        return (f"rank {r}: died (process {pid.read_text().strip()} is gone); "
                                "run the same command again to resume")
                time.sleep(0.1)
        return f"rank {self.rank}: lost contact with the other ranks ({first_line(err)})"

    def record_failure(self, message: str) -> str:
        """This rank's error, for the others to report; returns it prefixed with the rank (under several)."""
        if not self.active:
            return message
        line = message if message.startswith("rank ") else f"rank {self.rank}: {message}"
        (self.folder / f"rank-{self.rank}.error").write_text(line + "\n")
        return line

    def finished(self) -> None:
        """A successful run: every rank's files go once all are done."""
        if self.active:
            self.barrier()
            (self.folder / f"rank-{self.rank}.pid").unlink(missing_ok=True)
            if self.rank == 0:
                shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        if self.active and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def alive(pid: int) -> bool:
    """Whether process pid still runs (a zombie, killed but not yet reaped by torchrun, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def init(device_type: str, folder: Path) -> Ranks:
    """The ranks torchrun started this process among (WORLD_SIZE, RANK), or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    rank = int(os.environ["RANK"])
    if not torch.distributed.is_initialized():
        if device_type == "cuda":  # NCCL's collectives run on the current device: this rank's own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.distributed.init_process_group("nccl" if device_type == "cuda" else "gloo")
    folder.mkdir(parents=True, exist_ok=True)
    ranks = Ranks(rank, world, folder)
    (folder / f"rank-{rank}.error").unlink(missing_ok=True)
    (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))
    ranks.barrier()  # every stale error of an earlier run is gone before anyone can fail
    return ranks


def launch(nproc: int, args: list[str], output: Path) -> int:
    """`quantkit quantize --nproc N`: the same command under torchrun (standalone, one node). Worker output passes
    through; torchrun's own failure report is replaced by the failing rank's one line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "quantkit.cli", "quantize", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    report: list[str] = []  # torchrun's failure report: from its traceback on, after every worker ended
    for line in proc.stderr:
        if report or line.startswith("Traceback"):
            report.append(line)
        elif not _TORCHRUN.match(line) and not line.startswith("error: "):  # one error line is printed below
            sys.stderr.write(line)
    if proc.wait() == 0:
        return 0
    folder = output / FOLDER
    errors = sorted(folder.glob("rank-*.error")) if folder.is_dir() else []
    if errors:
        line = errors[0].read_text().strip()
    else:
        ended = re.findall(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", "".join(report), re.S)
        # torchrun stops the survivors with SIGTERM (-15): the rank that died first is one that it did not stop
        dead = next((e for e in ended if int(e[1]) != -signal.SIGTERM), ended[0] if ended else None)
        line = (f"rank {dead[0]}: died (exit code {dead[1]}); run the same command again to resume"
                if dead else f"torchrun failed with exit code {proc.returncode}")
    sys.stderr.write(f"error: {line}\n")
    return 2


_TORCHRUN = re.compile(r"^(\[?[WEI]\d{4} |\*{5}|Setting OMP_NUM_THREADS|WARNING:torch)")  # its logger
