"""A forward as CUDA graph pieces with eager calls between them: piece 0, call 0, piece 1, ..., piece n.

A prefill forward cannot be one graph: attention over the paged K/V and Gated DeltaNet's conv and chunked
delta rule read the batch's sequence layout (on the host too: fla's chunk table), and it changes with
every batch. Everything else (projections, norms, gates, the router and experts, residual adds) depends
only on the number of tokens. So the forward runs once with a `PieceBackend`, whose two break points are
the layers' only doors to that layout: `attend` and `outside_graph` (`HybridBackend`). At each, the piece
so far ends and the call is recorded (`EagerCall`); a replay runs the pieces and, between them, each call
with the live batch's backend (the approach of lmdeploy's piecewise prefill graphs and SGLang's for
Qwen3-Next, where likewise only the attention op and the Gated DeltaNet core stay outside the graphs).

Addresses are what a graph remembers, so an eager call reads and writes `Bridges`: static tensors the
piece before it copies the call's inputs into, and the call's result is copied into for the piece after
it. Every call of one shape and dtype shares its bridges (calls run one at a time, and each result is
read before the next call: `HybridBackend.outside_graph`'s contract), as does every bucket: a bucket of
R tokens uses their first R rows. Bridges come from the ordinary allocator, outside the graphs' pool.

Padding: a bucket of R rows replays a forward of T <= R tokens. A call computes only the T real rows (the
live batch has no others); it zeroes its result's rows T..R, and the padding tokens are token 0 at
position 0, so what the pieces compute for padding rows is the same on every replay, whatever an
earlier replay left in the bridges (a NaN there would be no one's answer, but could reach a kernel that
indexes by value, as the router's top-k does).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from morion.layers.hybrid_backend import HybridBackend

EagerOp = Callable[..., torch.Tensor]  # op(backend, *inputs) -> result, rows first (`outside_graph`'s)
# What a traced forward does at a break point with the call's op and its input bridges (cut to the
# bucket's rows): run it now and return its result (a warm-up), or end a piece and start the next (None).
AtBreak = Callable[[EagerOp, tuple[torch.Tensor, ...]], "torch.Tensor | None"]


class EagerCall(NamedTuple):
    """One break point of a traced forward: `op` reads `inputs` and its result goes to `output` (bridges
    of the largest bucket's rows)."""

    op: EagerOp
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor

    def run(self, backend: HybridBackend, rows: int, bucket: int) -> None:
        """`op` over the first `rows` rows with `backend` (the live batch's: exactly `rows` tokens); the
        rows of its output from `rows` to `bucket` (padding) zeroed."""
        result = self.op(backend, *(x[:rows] for x in self.inputs))
        self.output[:rows].copy_(result)
        if rows < bucket:
            self.output[rows:bucket].zero_()


class Traced(NamedTuple):
    hidden: torch.Tensor  # what the model's forward returned (the bucket's rows)
    calls: list[EagerCall]  # its break points, in order


# A forward of one bucket traced with the given `AtBreak` (the model over the bucket's static inputs).
PieceForward = Callable[[AtBreak], Traced]


class Replayable(Protocol):
    def replay(self) -> None: ...


class CapturedForward(NamedTuple):
    """A forward's pieces (one more than its calls) and calls, replayed alternately from piece 0; the
    last piece leaves the forward's result in `hidden`."""

    pieces: Sequence[Replayable]
    calls: list[EagerCall]
    hidden: torch.Tensor

    def replay(self, backend: HybridBackend, rows: int, bucket: int) -> torch.Tensor:
        """Piece 0, call 0 (with `backend`, over `rows` real rows of `bucket`), piece 1, ..., the last
        piece; returns the result's real rows (valid until the next replay of any bucket)."""
        for piece, call in zip(self.pieces, self.calls, strict=False):
            piece.replay()
            call.run(backend, rows, bucket)
        self.pieces[-1].replay()
        return self.hidden[:rows]


# Captures a traced forward's pieces: CUDA graphs (`capture_cuda_pieces`), or a stand-in on the CPU.
CapturePieces = Callable[[PieceForward], CapturedForward]


class Bridges:
    """The static tensors eager calls read and write, `rows` rows each (the largest bucket's), made on
    first use (a warm-up, never while capturing): inputs by (position, shape, dtype), outputs by (shape,
    dtype) of the call at each break point, which is the same for every bucket."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._tensors: dict[tuple[object, ...], torch.Tensor] = {}
        self._output_keys: dict[int, tuple[object, ...]] = {}  # by the break point's ordinal

    def input(self, position: int, like: torch.Tensor) -> torch.Tensor:
        return self._tensor(("input", position, *_layout(like)), like)

    def output(self, ordinal: int, result: torch.Tensor | None) -> torch.Tensor:
        """The output bridge of break point `ordinal`; `result` (a warm-up's) tells its shape, else the
        warm-up must have."""
        if result is not None:
            self._output_keys[ordinal] = ("output", *_layout(result))
            return self._tensor(self._output_keys[ordinal], result)
        key = self._output_keys.get(ordinal)
        if key is None:
            raise RuntimeError(f"break point {ordinal} of a piecewise forward was never warmed up")
        return self._tensors[key]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def _tensor(self, key: tuple[object, ...], like: torch.Tensor) -> torch.Tensor:
        tensor = self._tensors.get(key)
        if tensor is None:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"bridge {key} first needed while capturing (the warm-up did not run it)")
            tensor = torch.zeros(self.rows, *like.shape[1:], dtype=like.dtype, device=like.device)
            self._tensors[key] = tensor
        return tensor


def _layout(tensor: torch.Tensor) -> tuple[object, ...]:
    return (*tensor.shape[1:], tensor.dtype, tensor.device)


def _attend(
    layer_index: int,
    scale: float,
    backend: HybridBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    return backend.attend(layer_index, q, k, v, scale)


class PieceBackend:
    """What the layers see while a forward of `rows` tokens is traced: `attend` and `outside_graph` are
    break points (their inputs copied into bridges inside the piece that ends there, `at_break` called,
    the output bridge returned to the next piece); it is never a verify forward; anything else a layer
    asks of it raises, so per-sequence metadata or cache memory can never be read inside a piece (a model
    that needs more runs its prefill eagerly: the capture fails and says which)."""

    verify_slots = None

    def __init__(self, bridges: Bridges, rows: int, at_break: AtBreak) -> None:
        self._bridges = bridges
        self._rows = rows
        self._at_break = at_break
        self.calls: list[EagerCall] = []

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self.outside_graph(functools.partial(_attend, layer_index, scale), q, k, v)

    def outside_graph(self, op: EagerOp, *inputs: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        bridges = tuple(self._bridges.input(i, x) for i, x in enumerate(inputs))
        for bridge, x in zip(bridges, inputs, strict=True):
            bridge[:rows].copy_(x)  # the last work of the piece that ends here
        result = self._at_break(op, tuple(bridge[:rows] for bridge in bridges))
        output = self._bridges.output(len(self.calls), result)
        if result is not None:
            output[:rows].copy_(result)
        self.calls.append(EagerCall(op, bridges, output))
        return output[:rows]

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(
            f"a piecewise prefill graph gives its pieces no {name!r}, only attend and outside_graph (run "
            "eagerly between the pieces): a layer reads the batch's metadata or cache memory elsewhere"
        )


def capture_cuda_pieces(forward: PieceForward, pool: object, device: torch.device) -> CapturedForward:
    """The pieces of `forward` as CUDA graphs in memory pool `pool`, captured on a side stream in one
    pass of the forward: at each break point the graph so far ends and the next begins (the calls do not
    run). Every kernel must have been compiled by a warm-up of the same bucket first."""
    graphs: list[torch.cuda.CUDAGraph] = []

    def begin() -> None:
        graphs.append(torch.cuda.CUDAGraph())
        graphs[-1].capture_begin(pool=pool)

    def at_break(op: EagerOp, inputs: tuple[torch.Tensor, ...]) -> None:
        graphs[-1].capture_end()
        begin()

    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        begin()
        try:
            traced = forward(at_break)
        except BaseException:
            # End the open capture (its graph is dropped) so that the device can run eagerly after a
            # failure; the original error is the one to report.
            if torch.cuda.is_current_stream_capturing():
                with contextlib.suppress(RuntimeError):
                    graphs[-1].capture_end()
            raise
        graphs[-1].capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return CapturedForward(graphs, traced.calls, traced.hidden)
