"""The tensor transport seam: how a PSClient moves tensors and sync tokens to its PS tasks.

Two implementations sit behind it: `bulk.BulkTensors` (framed TCP, raw bytes, the default) and
`grpc_tensors.GrpcTensors` (`bulk_transport: false`, for networks where only gRPC ports are
reachable). The client plans requests (which items go to which PS task), retries and records
versions the same way over either; a transport performs one attempt and raises PsclusterError.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pscluster.proto import pscluster_pb2 as pb

PullPlan = dict[int, list[tuple[pb.PullItem, np.ndarray]]]  # PS task -> (item, array to fill)
PushPlan = dict[int, list[tuple[pb.PushItem, np.ndarray]]]  # PS task -> (item, gradient); item.grad: header only
ValueTargets = dict[int, list[np.ndarray]]  # fused push-pull: PS task -> arrays to fill, in its plan's item order


class TensorTransport(Protocol):
    """Pull and push plans, and the sync-token calls of PS 0."""

    def pull(self, plan: PullPlan) -> None:
        """Fill each target with its item's tensor."""

    def push(self, plan: PushPlan, head: pb.PushRequest, targets: ValueTargets | None = None) -> list[pb.PushReply]:
        """Send each item's gradient with head's push id, step and mark; one reply per request.

        With `head.return_values`, a PS that answers with values has them written into `targets` and
        its reply lists one `values` entry per item (header only over the bulk path); a reply without
        `values` (an accumulating PS) left its targets untouched.
        """

    def take_token(self, request: pb.TokenRequest, ps: int = 0) -> pb.TokenReply:
        """A sync token from the token queue on PS ps (blocks up to request.timeout_s while none is free)."""

    def step_done(self, request: pb.StepDoneRequest, ps: int = 0) -> pb.StepReply:
        """Report a closure's finished step to the token queue on PS ps (the reply: where it was counted)."""

    def moved(self, ps: int, address: str) -> None:
        """PS ps now listens at address (host:port of its gRPC server): drop connections to the old one."""

    def close(self) -> None:
        """Release connections."""
