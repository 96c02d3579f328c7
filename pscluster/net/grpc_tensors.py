"""The gRPC path for tensors (`bulk_transport: false`): one unary request per PS task, streams in
`chunk_bytes` chunks for shards above `stream_threshold_bytes`. Slower than the bulk TCP path (see
BENCHMARKS.md), kept for networks where only the gRPC port is reachable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, wait
from typing import Any

import grpc
import numpy as np

from pscluster import codec
from pscluster.errors import PsclusterError
from pscluster.net import rpc
from pscluster.net.channels import Channels
from pscluster.net.transport import PullPlan, PushPlan, ValueTargets
from pscluster.proto import pscluster_pb2 as pb

DRAIN_END_S = 5.0  # a cancelled PullStream's reader stops at its next chunk; bounded all the same


class GrpcTensors:
    """The TensorTransport over a client's gRPC channels; one attempt per call."""

    def __init__(self, channels: Channels) -> None:
        self._net = channels

    def _streams(self, nbytes: int, item: Any) -> bool:
        return nbytes > self._net.settings.stream_threshold_bytes and not item.HasField("ids")

    def pull(self, plan: PullPlan) -> None:
        """Fill each target with its item's tensor.

        Raises:
            PsclusterError: the first failed call's (after every call has finished or been given up).
        """
        c = self._net
        unary: PullPlan = defaultdict(list)
        streams: list[tuple[int, pb.PullItem, Any, Future[None]]] = []
        for ps, items in plan.items():
            for item, target in items:
                if self._streams(target.nbytes, item):
                    # started here, drained on the pool: this thread can cancel a call a stopped PS never answers
                    call = c.stubs[ps].PullStream(item, timeout=c.settings.rpc_timeout_s)
                    streams.append((ps, item, call, c.pool.submit(self._drain, ps, item, call, target)))
                else:
                    unary[ps].append((item, target))
        calls = [(ps, "Pull", pb.PullRequest(items=[i for i, _ in items])) for ps, items in unary.items()]
        first: PsclusterError | None = None
        try:
            for (ps, _, _), reply in zip(calls, c.gather(calls)):
                for (_, target), tensor in zip(unary[ps], reply.tensors):
                    target[...] = codec.decode(tensor).reshape(target.shape)
        except PsclusterError as exc:
            first = exc
        for ps, item, call, fut in streams:
            try:
                c.result(fut, ps, "Pull", pb.PullRequest(items=[item]), cancel=call.cancel)
            except PsclusterError as exc:
                first = first or exc
                # a given-up stream's drain ends (cancelled: at once) before a retry writes the same target
                wait([fut], timeout=DRAIN_END_S)
        if first is not None:
            raise first

    def _drain(self, ps: int, item: pb.PullItem, call: Any, target: np.ndarray) -> None:
        flat = target.reshape(-1).view(np.uint8)
        pos = 0
        try:
            for chunk in call:
                if chunk.HasField("header"):
                    continue
                flat[pos:pos + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
                pos += len(chunk.data)
        except grpc.RpcError as exc:
            raise rpc.translate(exc, f"ps {ps} PullStream {item.ref.variable}") from None
        if pos != flat.size:
            raise PsclusterError(f"ps {ps} PullStream {item.ref.variable}: got {pos} of {flat.size} bytes")

    def push(self, plan: PushPlan, head: pb.PushRequest, targets: ValueTargets | None = None) -> list[pb.PushReply]:
        """Send a push plan; replies in plan order (unary items per PS first, then streamed ones). Values
        of a fused push-pull come back only for PS tasks none of whose items streamed."""
        c = self._net
        unary: dict[int, list[pb.PushItem]] = defaultdict(list)
        streams: list[tuple[int, pb.ShardRef, Any]] = []
        for ps, items in plan.items():
            for item, part in items:
                if self._streams(part.nbytes, item):
                    streams.append((ps, item.ref, self._push_stream(ps, head, item.ref, part)))
                else:
                    full = pb.PushItem()
                    full.CopyFrom(item)
                    full.grad.CopyFrom(codec.encode(part))
                    unary[ps].append(full)
        calls = [(ps, "Push", pb.PushRequest(items=items, push_id=head.push_id, step=head.step,
                                             final_below=head.final_below, skip_step=head.skip_step,
                                             return_values=head.return_values and len(items) == len(plan[ps])))
                 for ps, items in unary.items()]
        first: PsclusterError | None = None
        replies: list[pb.PushReply] = []
        try:
            replies = list(c.gather(calls))
        except PsclusterError as exc:
            first = exc
        for (ps, _, _), reply in zip(calls, replies):
            if targets and len(reply.values) == len(targets[ps]):
                for target, tensor in zip(targets[ps], reply.values):
                    target[...] = codec.decode(tensor).reshape(target.shape)
        for ps, ref, fut in streams:
            try:
                replies.append(c.result(fut, ps, "Push", pb.PushRequest(items=[pb.PushItem(ref=ref)])))
            except grpc.RpcError as exc:
                first = first or rpc.translate(exc, f"ps {ps} PushStream {ref.variable}")
            except PsclusterError as exc:
                first = first or exc
        if first is not None:
            raise first from None  # the status says it all; grpc's own frames only bury it
        return replies

    def _push_stream(self, ps: int, head: pb.PushRequest, ref: pb.ShardRef, grad: np.ndarray) -> Any:
        """The started PushStream call of one item (a gRPC future of its PushReply)."""
        grad = np.ascontiguousarray(grad, dtype=grad.dtype.newbyteorder("<"))
        flat = grad.reshape(-1).view(np.uint8)
        chunk = self._net.settings.chunk_bytes

        def messages() -> Iterator[pb.PushChunk]:
            item = pb.PushItem(ref=ref, grad=codec.header(grad.dtype, grad.shape))
            yield pb.PushChunk(header=pb.PushRequest(items=[item], push_id=head.push_id, step=head.step,
                                                     final_below=head.final_below))
            for start in range(0, flat.size, chunk):
                yield pb.PushChunk(data=flat[start:start + chunk].tobytes())

        return self._net.stubs[ps].PushStream.future(messages(), timeout=self._net.settings.rpc_timeout_s)

    def take_token(self, request: pb.TokenRequest, ps: int = 0) -> pb.TokenReply:
        """A sync token from PS ps's queue (blocks while none is free)."""
        reply: pb.TokenReply = self._net.call(ps, "TakeToken", request,
                                              timeout=request.timeout_s + self._net.settings.rpc_timeout_s)
        return reply

    def step_done(self, request: pb.StepDoneRequest, ps: int = 0) -> pb.StepReply:
        """Report a closure's finished step to PS ps's queue."""
        reply: pb.StepReply = self._net.call(ps, "StepDone", request)
        return reply

    def moved(self, ps: int, address: str) -> None:
        """Nothing of its own: the channels already hold the new stub."""

    def close(self) -> None:
        """Nothing of its own: the channels' owner closes them."""
