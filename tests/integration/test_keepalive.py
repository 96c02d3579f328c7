"""An idle connection outlives our own keepalive pings: the server accepts them (real sockets, in-process).

gRPC's server default accepts a ping without calls once per 5 minutes and ends the connection after three
early ones (GOAWAY ENHANCE_YOUR_CALM "too_many_pings"), while our clients ping every KEEPALIVE_MS with no
call: every long idle period logged the GOAWAY and dropped the connection. The test scales the keepalive
down to gRPC's floor (one ping a second), idles past four of them and checks the connection never left READY.
"""

import threading
import time
from concurrent import futures

import grpc

from pscluster.config import ClusterSpec, Settings
from pscluster.net import rpc

KEEPALIVE_MS = 1000  # gRPC sends no keepalive ping more often than once a second
IDLE_S = 5.0  # the old options ended the connection after the fourth ping (~4 s)


def test_an_idle_connection_pinged_by_our_keepalive_is_not_ended_and_the_next_call_works():
    options = rpc.channel_options(Settings(cluster=ClusterSpec(ps=["127.0.0.1:1"])), keepalive_ms=KEEPALIVE_MS)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Echo": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    states: list[grpc.ChannelConnectivity] = []
    lock = threading.Lock()

    def seen(state: grpc.ChannelConnectivity) -> None:
        with lock:
            states.append(state)

    channel.subscribe(seen)
    try:
        call = channel.unary_unary("/t.Echo/Echo")
        assert call(b"first", timeout=10) == b"first"
        time.sleep(IDLE_S)  # idle: only keepalive pings cross the connection (the condition under test is time)
        with lock:
            after_ready = states[states.index(grpc.ChannelConnectivity.READY):]
        assert after_ready == [grpc.ChannelConnectivity.READY], f"the connection was ended while idle: {after_ready}"
        assert call(b"next", timeout=10) == b"next"
    finally:
        channel.unsubscribe(seen)
        channel.close()
        server.stop(0).wait(10)
