"""Transports: the framed bulk-tensor wire (framing, frame loop and server, shared memory), gRPC
plumbing (rpc: channels, the one server interceptor and client translation, admission and refusals),
and TLS. Each call makes one attempt; retries live in the client core.

May import: the API modules at the package root (errors, config) and `pscluster.proto`. Never the
client core, a role or `pscluster.ops`.
"""
