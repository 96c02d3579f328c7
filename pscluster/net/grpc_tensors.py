"""The gRPC path for tensors (`bulk_transport: false`): one unary request per PS task, streams in
`chunk_bytes` chunks for shards above `stream_threshold_bytes`. Slower than the bulk TCP path (see
BENCHMARKS.md), kept for networks where only the gRPC port is reachable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from pscluster.net import codec, rpc
from pscluster.errors import PsclusterError
from pscluster.proto import pscluster_pb2 as pb
from pscluster.client.tensors import PullPlan, PushPlan, ValueTargets

if TYPE_CHECKING:
    from pscluster.client.client import PSClient



class GrpcTensors:
    """The TensorTransport over a PSClient's gRPC stubs."""

    def __init__(self, client: PSClient) -> None:
        self._client = client

    def _streams(self, nbytes: int, item: Any) -> bool:
        return nbytes > self._client.settings.stream_threshold_bytes and not item.HasField("ids")

    def pull(self, plan: PullPlan) -> None:
        """Fill each target with its item's tensor."""
        c = self._client
        unary: PullPlan = defaultdict(list)
        streams: list[Future[None]] = []
        for ps, items in plan.items():
            for item, target in items:
                if self._streams(target.nbytes, item):
                    streams.append(c._pool.submit(self._pull_stream, ps, item, target))  # noqa: SLF001
                else:
                    unary[ps].append((item, target))
        calls = [(ps, "Pull", pb.PullRequest(items=[i for i, _ in items])) for ps, items in unary.items()]
        for (ps, _, _), reply in zip(calls, c._gather(calls)):  # noqa: SLF001
            for (_, target), tensor in zip(unary[ps], reply.tensors):
                target[...] = codec.decode(tensor).reshape(target.shape)
        for fut in streams:
            fut.result()

    def _pull_stream(self, ps: int, item: pb.PullItem, target: np.ndarray) -> None:
        flat = target.reshape(-1).view(np.uint8)
        pos = 0
        try:
            for chunk in self._client.stubs[ps].PullStream(item, timeout=self._client.settings.rpc_timeout_s):
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
        c = self._client
        unary: dict[int, list[pb.PushItem]] = defaultdict(list)
        streams: list[Future[pb.PushReply]] = []
        for ps, items in plan.items():
            for item, part in items:
                if self._streams(part.nbytes, item):
                    streams.append(c._pool.submit(self._push_stream, ps, head, item.ref, part))  # noqa: SLF001
                else:
                    full = pb.PushItem()
                    full.CopyFrom(item)
                    full.grad.CopyFrom(codec.encode(part))
                    unary[ps].append(full)
        calls = [(ps, "Push", pb.PushRequest(items=items, push_id=head.push_id, step=head.step,
                                             final_below=head.final_below,
                                             return_values=head.return_values and len(items) == len(plan[ps])))
                 for ps, items in unary.items()]
        replies: list[pb.PushReply] = list(c._gather(calls))  # noqa: SLF001
        for (ps, _, _), reply in zip(calls, replies):
            if targets and len(reply.values) == len(targets[ps]):
                for target, tensor in zip(targets[ps], reply.values):
                    target[...] = codec.decode(tensor).reshape(target.shape)
        return replies + [fut.result() for fut in streams]

    def _push_stream(self, ps: int, head: pb.PushRequest, ref: pb.ShardRef, grad: np.ndarray) -> pb.PushReply:
        grad = np.ascontiguousarray(grad, dtype=grad.dtype.newbyteorder("<"))
        flat = grad.reshape(-1).view(np.uint8)
        chunk = self._client.settings.chunk_bytes

        def messages() -> Iterator[pb.PushChunk]:
            item = pb.PushItem(ref=ref, grad=codec.header(grad.dtype, grad.shape))
            yield pb.PushChunk(header=pb.PushRequest(items=[item], push_id=head.push_id, step=head.step,
                                                     final_below=head.final_below))
            for start in range(0, flat.size, chunk):
                yield pb.PushChunk(data=flat[start:start + chunk].tobytes())

        def once(_request: Any, timeout: float) -> pb.PushReply:
            return self._client.stubs[ps].PushStream(messages(), timeout=timeout)

        return rpc.call(once, None, timeout=self._client.settings.rpc_timeout_s,
                        what=f"ps {ps} PushStream {ref.variable}", retry_for=self._client.retry_for)

    def take_token(self, request: pb.TokenRequest) -> pb.TokenReply:
        """A sync token from PS 0's queue (blocks while none is free)."""
        c = self._client
        return rpc.call(c.stubs[0].TakeToken, request, timeout=request.timeout_s + c.settings.rpc_timeout_s,
                        what="ps 0 TakeToken")

    def step_done(self, request: pb.StepDoneRequest) -> None:
        """Report a closure's finished step to PS 0."""
        rpc.call(self._client.stubs[0].StepDone, request, timeout=self._client.settings.rpc_timeout_s,
                 what="ps 0 StepDone")

    def moved(self, ps: int, address: str) -> None:
        """Nothing of its own: the client's stubs are already the new ones."""

    def close(self) -> None:
        """Nothing of its own: the client closes the channels."""
