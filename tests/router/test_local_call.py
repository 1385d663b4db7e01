"""The in-process `Generate` seam: a local call ends as the gRPC call it stands for would.

The servicers here are small generators with the servicer's signature: the seam is what is
under test (the real servicer runs through it in tests/e2e/test_openai_http.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from pdserve.router.local_call import LocalGeneration


def run(coro):
    return asyncio.run(coro)


def test_messages_arrive_in_order_then_eof_and_the_end_callbacks_run_once():
    ended = []

    def servicer(request, context):
        assert context.add_callback(lambda: ended.append("cb"))
        assert dict(context.invocation_metadata()) == {"authorization": "Bearer k"}
        assert 0 < context.time_remaining() <= 5
        for i in range(request):
            yield i

    async def main():
        gen = LocalGeneration(servicer, max_workers=2)
        call = gen.Generate(3, timeout=5, metadata=(("authorization", "Bearer k"),))
        got = [m async for m in call]
        assert await call.read() is grpc.aio.EOF  # and again after the end
        assert call.cancel() is False  # already ended
        gen.close()
        return got

    assert run(main()) == [0, 1, 2]
    assert ended == ["cb"]


def test_messages_yielded_while_the_loop_was_busy_are_taken_in_one_pass_then_the_end():
    release = threading.Event()

    def servicer(request, context):
        for i in range(request):
            yield i
        release.set()

    async def main():
        gen = LocalGeneration(servicer, max_workers=1)
        call = gen.Generate(50, timeout=5)
        while not release.is_set():  # the loop is busy: the servicer runs ahead of it
            time.sleep(0.01)
        time.sleep(0.05)  # its end is handed over too
        first = await call.read()
        rest = []
        while (m := call.read_ready()) is not None:
            rest.append(m)
        assert call.read_ready() is None  # the end is never taken here...
        end = await call.read()  # ...but by read, as it would have been
        gen.close()
        return [first, *rest], end

    got, end = run(main())
    assert got == list(range(50)) and end is grpc.aio.EOF


def test_messages_sent_from_another_thread_keep_their_order_and_calls_share_wake_ups():
    """What a servicer sends through `context.emit` (from a thread of its own, as the decode
    relay does) comes between what it yielded before and after, in order; once the call ended
    nothing more is taken. Messages for several calls handed over while the loop was busy
    reach all of them on one wake-up."""
    both_sent = threading.Barrier(3)

    def servicer(request, context):
        yield f"{request}-first"
        sender = threading.Thread(target=lambda: [context.emit(f"{request}-{i}")
                                                  for i in range(3)])
        sender.start()
        sender.join()
        both_sent.wait(5)
        yield f"{request}-last"

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        gen = LocalGeneration(servicer, max_workers=2)
        a, b = gen.Generate("a", timeout=5), gen.Generate("b", timeout=5)
        both_sent.wait(5)  # the loop is busy: both servicers' messages wait for it
        time.sleep(0.05)
        got = [[m async for m in a], [m async for m in b]]
        gen.close()
        return got, wakeups

    got, wakeups = run(main())
    assert got == [[f"{r}-first", f"{r}-0", f"{r}-1", f"{r}-2", f"{r}-last"] for r in "ab"]
    assert wakeups <= 2  # not one per message (10, and the two ends)

    def late(request, context):
        yield "only"
        while context.is_active():  # until the reader cancels
            time.sleep(0.01)
        context.emit("after the end")  # never read

    async def cancelled():
        gen = LocalGeneration(late, max_workers=1)
        call = gen.Generate(None, timeout=5)
        first = await call.read()
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        gen.close()
        return first, err.value.code()

    assert run(cancelled()) == ("only", grpc.StatusCode.CANCELLED)


def test_abort_ends_the_call_with_its_code_details_and_trailers():
    def servicer(request, context):
        yield "first"
        context.set_trailing_metadata((("retry-after", "3"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        yield "never"

    async def main():
        call = LocalGeneration(servicer, 1).Generate(None, timeout=5)
        assert await call.read() == "first"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        return e.value

    err = run(main())
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "queue full"
    assert err.trailing_metadata().get("retry-after") == "3"


def test_an_exception_in_the_servicer_is_unknown_naming_it():
    def servicer(request, context):
        raise ValueError("bad state")
        yield  # a generator

    async def main():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await LocalGeneration(servicer, 1).Generate(None, timeout=5).read()
        return e.value

    err = run(main())
    assert err.code() is grpc.StatusCode.UNKNOWN
    assert "bad state" in err.details()


def test_cancel_runs_the_callbacks_wakes_a_blocked_servicer_and_it_stops_being_pulled():
    woke = threading.Event()
    pulled = []
    closed = threading.Event()

    def servicer(request, context):
        context.add_callback(woke.set)  # as the service cancels its worker call
        try:
            yield "one"
            assert woke.wait(5)  # blocked until the cancel's callback wakes it
            assert not context.is_active()
            pulled.append("after cancel")
            yield "two"
            pulled.append("pulled again")
        finally:
            closed.set()

    async def main():
        call = LocalGeneration(servicer, 1).Generate(None, timeout=5)
        assert await call.read() == "one"
        assert call.cancel() is True
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        return e.value

    err = run(main())
    assert err.code() is grpc.StatusCode.CANCELLED
    assert closed.wait(5)
    assert pulled == ["after cancel"]  # "two" was made but not pulled past


def test_past_its_deadline_the_call_fails_deadline_exceeded_and_the_servicer_is_told():
    told = threading.Event()

    def servicer(request, context):
        context.add_callback(told.set)
        yield "one"
        told.wait(5)
        yield "late"

    async def main():
        call = LocalGeneration(servicer, 1).Generate(None, timeout=0.2)
        assert await call.read() == "one"
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        return e.value, time.monotonic() - t0

    err, waited = run(main())
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert told.is_set() and waited < 5


def test_calls_beyond_the_pool_wait_for_a_thread_and_close_ends_what_still_runs():
    release = threading.Event()
    started = []

    def servicer(request, context):
        started.append(request)
        yield request
        release.wait(5)

    async def main():
        gen = LocalGeneration(servicer, max_workers=1)
        a, b = gen.Generate("a", timeout=5), gen.Generate("b", timeout=5)
        assert await a.read() == "a"
        await asyncio.sleep(0.1)
        assert started == ["a"]  # b waits for the one thread
        release.set()
        assert await a.read() is grpc.aio.EOF
        assert await b.read() == "b"
        assert await b.read() is grpc.aio.EOF
        release.clear()
        c = gen.Generate("c", timeout=5)
        assert await c.read() == "c"
        gen.close()  # c still runs: it is ended as the router stops
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.read()
        release.set()
        return e.value

    err = run(main())
    assert err.code() is grpc.StatusCode.UNAVAILABLE


def test_a_pool_needs_a_thread():
    with pytest.raises(ValueError, match="max_workers"):
        LocalGeneration(lambda r, c: iter(()), 0)
